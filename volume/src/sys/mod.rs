//! Filesystem primitives. Linux only: the rest of the crate is gated on it.

mod linux;

pub use linux::*;
