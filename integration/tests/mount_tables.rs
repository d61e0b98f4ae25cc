//! The mount tables read again between two steps see every mount,
//! unmount and rename made in between, in this namespace and in another
//! one's that was already read: `volume::mounts::MountTables::read_fresh`
//! shares one read among the threads asking at once, and a read older than
//! the call (or a table kept from one, read again only when the kernel
//! reports a mount or an unmount: a rename is not reported) would show a
//! volume unmounted that a dependent's container holds, or a tree taken
//! off a volume's name unheld. On real mounts, its own test binary (a
//! mount made in this namespace would be copied into any namespace another
//! test's process made meanwhile).

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use integration::{LoopFs, fs_or_skip};
use volume::mounts::{MountTables, MountUse};

fn uses(path: &Path) -> Vec<MountUse> {
    MountTables::read_fresh()
        .expect("reading the mount tables")
        .uses_of(path)
}

/// Kills the container on the way out, however the test ends (its
/// `sleep` would hold the test's output open).
struct Kill(std::process::Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Unmounts `at` on the way out, however the test ends.
struct Unmount<'a>(&'a Path);
impl Drop for Unmount<'_> {
    fn drop(&mut self) {
        let _ = rustix::mount::unmount(self.0, rustix::mount::UnmountFlags::DETACH);
    }
}

#[test]
fn a_mount_or_unmount_after_a_read_is_in_the_next_read() {
    let fs = fs_or_skip!(LoopFs::btrfs(256 << 20));
    let volume = fs.path("volumes/app");
    fs::create_dir_all(volume.join("data")).expect("mkdir");
    let at = fs.path("container");
    fs::create_dir_all(&at).expect("mkdir");
    let here = fs.path("here");
    fs::create_dir_all(&here).expect("mkdir");
    // A container: a namespace of its own, which mounts and unmounts the
    // volume when told to.
    let script = format!(
        "echo ready; read line; mount --bind '{src}' '{at}' && echo mounted; \
         read line; echo renamed; read line; umount '{at}' && echo unmounted; exec sleep 600",
        src = volume.display(),
        at = at.display(),
    );
    let mut child = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("unshare");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let child = Kill(child);
    let mut step = |say: &str, want: &str| {
        if !say.is_empty() {
            writeln!(stdin, "{say}").expect("tell the container");
        }
        let mut line = String::new();
        stdout.read_line(&mut line).expect("hear the container");
        assert_eq!(line.trim(), want, "the container");
    };
    step("", "ready");
    // Read with the container's namespace in it, before its mount.
    assert!(uses(&volume).is_empty());
    step("mount", "mounted");
    let seen = uses(&volume);
    assert!(
        seen.iter()
            .any(|u| !u.own_namespace && u.pids.contains(&child.0.id())),
        "the container's mount, made after a read, is missing: {seen:?}"
    );
    // Taken off its name (as a rollback moves the replaced tree aside): the
    // container's mount is now of the new path, no mount or unmount made.
    let aside = fs.path("volumes/app.held");
    fs::rename(&volume, &aside).expect("rename");
    step("rename", "renamed");
    let seen = uses(&aside);
    assert!(
        seen.iter().any(|u| !u.own_namespace),
        "the container's mount, of a tree renamed after a read, is missing: {seen:?}"
    );
    fs::rename(&aside, &volume).expect("rename back");
    step("unmount", "unmounted");
    assert!(uses(&volume).is_empty(), "{:?}", uses(&volume));
    // And in this namespace.
    rustix::mount::mount_bind(&volume, &here).expect("bind mount");
    let _unmount = Unmount(&here);
    let seen = uses(&volume);
    assert!(
        seen.iter()
            .any(|u| u.own_namespace && u.mount_point == here),
        "this namespace's mount, made after a read, is missing: {seen:?}"
    );
    rustix::mount::unmount(&here, rustix::mount::UnmountFlags::empty()).expect("unmount");
    assert!(uses(&volume).is_empty(), "{:?}", uses(&volume));
}
