//! Install finalization (stop, snapshot, install, then drop or restore) and
//! boot-time reconcile. Not built yet: see the open `core` issue.
