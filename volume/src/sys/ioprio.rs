//! The I/O priority of the calling thread (`ioprio_get(2)`,
//! `ioprio_set(2)`), which rustix does not wrap.
//!
//! Linux keeps the priority per thread, so a thread borrowed from a pool
//! (tokio's blocking threads) must get its own back: [`IdleIo`] restores
//! it when dropped.

use std::io;

/// `IOPRIO_WHO_PROCESS`: with `who` 0, the calling thread.
const WHO_PROCESS: libc::c_long = 1;
/// Where the class sits in a priority value.
const CLASS_SHIFT: u32 = 13;
/// `IOPRIO_CLASS_IDLE`: served only when no other task has I/O waiting.
const CLASS_IDLE: libc::c_long = 3;

fn get() -> io::Result<libc::c_long> {
    super::fault::check("ioprio_get")?;
    // SAFETY: ioprio_get takes two integers and reads no memory of ours.
    let r = unsafe { libc::syscall(libc::SYS_ioprio_get, WHO_PROCESS, 0 as libc::c_long) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

fn set(value: libc::c_long) -> io::Result<()> {
    super::fault::check("ioprio_set")?;
    // SAFETY: ioprio_set takes three integers and reads no memory of ours.
    let r = unsafe { libc::syscall(libc::SYS_ioprio_set, WHO_PROCESS, 0 as libc::c_long, value) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The calling thread in the idle I/O class until dropped, then back at
/// the priority it had. The class orders the block layer's queue where its
/// scheduler honours classes (BFQ; `none` and `mq-deadline` serve requests
/// as they come), and does not reach what btrfs's own threads write at a
/// commit on the thread's behalf.
///
/// Not `Send`: dropped on another thread, it would set that thread's.
#[must_use = "the priority is restored when this is dropped"]
#[derive(Debug)]
pub struct IdleIo {
    previous: libc::c_long,
    /// The priority is the thread's: the guard must drop where it was made.
    _thread_bound: std::marker::PhantomData<*const ()>,
}

impl IdleIo {
    /// Enters the idle class. An error leaves the priority unchanged.
    pub fn enter() -> io::Result<IdleIo> {
        let previous = get()?;
        set(CLASS_IDLE << CLASS_SHIFT)?;
        Ok(IdleIo {
            previous,
            _thread_bound: std::marker::PhantomData,
        })
    }

    /// The class the calling thread is in now (0 none, 1 real time, 2
    /// best effort, 3 idle).
    pub fn current_class() -> io::Result<u8> {
        // The class is the top three bits of a 16-bit value.
        Ok(((get()? >> CLASS_SHIFT) & 0x7) as u8)
    }
}

impl Drop for IdleIo {
    fn drop(&mut self) {
        if let Err(e) = set(self.previous) {
            tracing::warn!(error = %e, "restoring the thread's I/O priority");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_for_as_long_as_the_guard_lives() {
        let before = IdleIo::current_class().unwrap();
        assert_ne!(before, 3, "the test thread starts idle");
        {
            let _idle = IdleIo::enter().unwrap();
            assert_eq!(IdleIo::current_class().unwrap(), 3);
        }
        assert_eq!(IdleIo::current_class().unwrap(), before);
    }
}
