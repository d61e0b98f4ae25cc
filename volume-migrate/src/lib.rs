//! One-time conversion of plain package volume directories into btrfs
//! subvolumes. Not built yet: see the open `volume-migrate` issue.
