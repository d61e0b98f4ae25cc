//! Scratch filesystems on loop devices, torn down on drop.
//!
//! Every [`LoopFs`] owns its own temporary directory holding a sparse image file and
//! the mount point, and its own loop device, so tests can run in parallel without
//! sharing any state.

use std::ffi::OsString;
use std::fmt;
use std::fs::{self, File};
use std::io::{self, ErrorKind};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::Duration;

use rustix::mount::UnmountFlags;
use tempfile::TempDir;

use crate::cmd::run;

/// Environment variable that overrides where images and mount points are created.
pub const TMPDIR_ENV: &str = "INTEGRATION_TMPDIR";

/// The kind of filesystem a [`LoopFs`] is formatted with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FsKind {
    /// btrfs, the filesystem package volumes are meant to live on.
    Btrfs,
    /// ext4, for the code paths that must fall back to plain directories.
    Ext4,
}

impl FsKind {
    /// The name used by `mount -t` and listed in `/proc/filesystems`.
    pub fn fs_type(self) -> &'static str {
        match self {
            FsKind::Btrfs => "btrfs",
            FsKind::Ext4 => "ext4",
        }
    }

    fn mkfs_program(self) -> &'static str {
        match self {
            FsKind::Btrfs => "mkfs.btrfs",
            FsKind::Ext4 => "mkfs.ext4",
        }
    }

    /// Quiet and forced: the image is a fresh sparse file, but an earlier image with
    /// the same content signature would otherwise make mkfs ask for confirmation.
    fn mkfs_default_args(self) -> &'static [&'static str] {
        match self {
            FsKind::Btrfs => &["-q", "-f"],
            FsKind::Ext4 => &["-q", "-F"],
        }
    }
}

impl fmt::Display for FsKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.fs_type())
    }
}

/// Checks that this process can build a loop-mounted filesystem of `kind`.
///
/// Returns the reason when it cannot: not root, no loop device support, a missing
/// tool, or a kernel without the filesystem.
pub fn check_support(kind: FsKind) -> Result<(), String> {
    if !rustix::process::geteuid().is_root() {
        return Err("not running as root (needed for losetup and mount)".into());
    }
    if !Path::new("/dev/loop-control").exists() {
        return Err("no /dev/loop-control: loop devices are not available".into());
    }
    for tool in ["losetup", "mount", kind.mkfs_program()] {
        if find_program(tool).is_none() {
            return Err(format!("`{tool}` not found in PATH (run `make deps`)"));
        }
    }
    if !kernel_supports(kind.fs_type()) {
        // A modular kernel lists a filesystem only once its module is loaded.
        let _ = Command::new("modprobe")
            .arg("-q")
            .arg(kind.fs_type())
            .output();
        if !kernel_supports(kind.fs_type()) {
            return Err(format!("the kernel does not support {kind}"));
        }
    }
    Ok(())
}

fn kernel_supports(fs_type: &str) -> bool {
    fs::read_to_string("/proc/filesystems")
        .map(|list| {
            list.lines()
                .any(|line| line.split_whitespace().last() == Some(fs_type))
        })
        .unwrap_or(false)
}

/// Looks `name` up in `PATH`, plus the sbin directories that a non-login root shell
/// may lack but where mkfs and losetup live on Debian.
fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// The full path of a tool that [`check_support`] found.
fn program(name: &str) -> io::Result<PathBuf> {
    find_program(name)
        .ok_or_else(|| io::Error::new(ErrorKind::NotFound, format!("`{name}` not found")))
}

/// True when the environment says this is a CI run (`CI=true` or `CI=1`).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// Decides what a test does when loop-mounted btrfs is unavailable.
///
/// Returns true when the test can go on. Otherwise, under CI (`CI=true`) it panics, since
/// a CI machine that silently skips every filesystem test proves nothing; elsewhere it
/// prints `skipping: <reason>` to stderr and returns false so the test can return early.
#[track_caller]
pub fn require_root_and_loop() -> bool {
    require_support(FsKind::Btrfs)
}

/// Like [`require_root_and_loop`], for a filesystem of `kind`.
#[track_caller]
pub fn require_support(kind: FsKind) -> bool {
    match check_support(kind) {
        Ok(()) => true,
        Err(reason) => {
            skip_or_fail(&reason);
            false
        }
    }
}

/// Handles a capability gap: panics under CI, otherwise prints `skipping: <reason>`.
#[track_caller]
pub fn skip_or_fail(reason: &str) {
    if in_ci() {
        panic!("CI=true but this machine cannot run filesystem tests: {reason}");
    }
    eprintln!("skipping: {reason}");
}

/// Handles the error from creating a [`LoopFs`]; used by [`fs_or_skip!`](crate::fs_or_skip).
///
/// A missing capability (reported by [`LoopFs`] constructors as
/// [`ErrorKind::Unsupported`]) goes to [`skip_or_fail`]; any other error is a real
/// failure and panics.
#[track_caller]
pub fn skip_or_panic(err: io::Error) {
    if err.kind() == ErrorKind::Unsupported {
        skip_or_fail(&err.to_string());
    } else {
        panic!("cannot set up a loop-mounted filesystem: {err}");
    }
}

/// Creates a [`LoopFs`] or skips the test.
///
/// `fs_or_skip!(LoopFs::btrfs(512 << 20))` evaluates to the `LoopFs`. When the machine
/// lacks what it needs (root, loop devices, tools, kernel support), the enclosing test
/// returns early after printing `skipping: <reason>`, or fails when `CI=true`. Any
/// other setup error fails the test. In a test that returns a value, pass it as the
/// second argument: `fs_or_skip!(LoopFs::btrfs(size), Ok(()))`.
#[macro_export]
macro_rules! fs_or_skip {
    ($fs:expr) => {
        $crate::fs_or_skip!($fs, ())
    };
    ($fs:expr, $skipped:expr) => {
        match $fs {
            ::std::result::Result::Ok(fs) => fs,
            ::std::result::Result::Err(err) => {
                $crate::skip_or_panic(err);
                return $skipped;
            }
        }
    };
}

/// Options for a [`LoopFs`] beyond kind and size.
#[derive(Clone, Debug)]
pub struct LoopFsBuilder {
    kind: FsKind,
    size_bytes: u64,
    mkfs_args: Vec<OsString>,
    mount_options: Vec<String>,
}

impl LoopFsBuilder {
    /// Adds one `-o` option for mount, e.g. `"compress=zstd"` or `"noatime"`.
    pub fn mount_option(mut self, option: impl Into<String>) -> Self {
        self.mount_options.push(option.into());
        self
    }

    /// Adds an extra argument for mkfs, e.g. `"--nodesize"` then `"16k"`.
    pub fn mkfs_arg(mut self, arg: impl Into<OsString>) -> Self {
        self.mkfs_args.push(arg.into());
        self
    }

    /// Creates the image, formats it, attaches a loop device and mounts it.
    ///
    /// Fails with [`ErrorKind::Unsupported`] when [`check_support`] fails, so that
    /// [`fs_or_skip!`](crate::fs_or_skip) can tell "cannot run here" from "broken".
    /// Whatever was set up before a failure is torn down again.
    pub fn create(self) -> io::Result<LoopFs> {
        check_support(self.kind)
            .map_err(|reason| io::Error::new(ErrorKind::Unsupported, reason))?;

        let dir = tempfile::Builder::new()
            .prefix(&format!("itest-{}-", self.kind))
            .tempdir_in(scratch_root())?;
        // A canonical path, so it matches what /proc/self/mounts reports.
        let root = dir.path().canonicalize()?;
        let image = root.join("fs.img");
        let mount_point = root.join("mnt");
        File::create(&image)?.set_len(self.size_bytes)?;
        fs::create_dir(&mount_point)?;

        // mkfs.btrfs first checks that the image is not mounted by reading
        // every loop device's backing file; one detached meanwhile (another
        // test's teardown) fails that check with "No such device". Only
        // that failure is retried.
        let mut tries = 0;
        loop {
            let made = run(Command::new(program(self.kind.mkfs_program())?)
                .args(self.kind.mkfs_default_args())
                .args(&self.mkfs_args)
                .arg(&image));
            match made {
                Err(e) if tries < 4 && e.to_string().contains("cannot check mount status") => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                other => {
                    other?;
                    break;
                }
            }
        }

        // From here on, Drop of `fs` undoes whatever got done if a later step fails.
        let fs = LoopFs {
            kind: self.kind,
            dir: Some(dir),
            image,
            device: PathBuf::new(),
            mount_point,
            mount_options: self.mount_options.join(","),
            attached: false,
            mounted: false,
        };
        fs.attach_and_mount()
    }
}

/// Where temporary images go: `$INTEGRATION_TMPDIR`, else `/var/tmp` (on disk, unlike
/// a tmpfs `/tmp`, so multi-GiB images don't eat RAM), else the system temp dir.
fn scratch_root() -> PathBuf {
    if let Some(dir) = std::env::var_os(TMPDIR_ENV) {
        return PathBuf::from(dir);
    }
    let var_tmp = Path::new("/var/tmp");
    if var_tmp.is_dir() {
        var_tmp.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// A filesystem image attached to a loop device and mounted at a private mount point.
///
/// Dropping it (also while unwinding from a panic) unmounts the filesystem, lazily if
/// it stays busy, detaches the loop device and removes the image. Teardown problems
/// are printed as warnings; call [`LoopFs::close`] to see them as an error instead.
#[derive(Debug)]
pub struct LoopFs {
    kind: FsKind,
    /// `None` once teardown decided the directory must be leaked (see `teardown`).
    dir: Option<TempDir>,
    image: PathBuf,
    device: PathBuf,
    mount_point: PathBuf,
    mount_options: String,
    attached: bool,
    mounted: bool,
}

impl LoopFs {
    /// A fresh btrfs of `size_bytes` (at least about 120 MiB; the image is sparse).
    pub fn btrfs(size_bytes: u64) -> io::Result<LoopFs> {
        Self::builder(FsKind::Btrfs, size_bytes).create()
    }

    /// A fresh ext4 of `size_bytes` (the image is sparse).
    pub fn ext4(size_bytes: u64) -> io::Result<LoopFs> {
        Self::builder(FsKind::Ext4, size_bytes).create()
    }

    /// A fresh filesystem mounted with `options`, a comma-separated `mount -o` list
    /// such as `"compress=zstd,noatime"`.
    pub fn with_mount_options(kind: FsKind, size_bytes: u64, options: &str) -> io::Result<LoopFs> {
        options
            .split(',')
            .filter(|opt| !opt.is_empty())
            .fold(Self::builder(kind, size_bytes), |b, opt| {
                b.mount_option(opt)
            })
            .create()
    }

    /// A builder for a filesystem with extra mkfs arguments or mount options.
    pub fn builder(kind: FsKind, size_bytes: u64) -> LoopFsBuilder {
        LoopFsBuilder {
            kind,
            size_bytes,
            mkfs_args: Vec::new(),
            mount_options: Vec::new(),
        }
    }

    /// Attaches and mounts an existing image: `image` is moved into a fresh
    /// directory of this `LoopFs` (so it is deleted on drop, as any image of
    /// ours) and mounted with `options` (comma-separated, may be empty).
    /// Fails with [`ErrorKind::Unsupported`] when loop-mounted `kind` is not
    /// possible here.
    pub fn from_image(kind: FsKind, image: &Path, options: &str) -> io::Result<LoopFs> {
        check_support(kind).map_err(|reason| io::Error::new(ErrorKind::Unsupported, reason))?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("itest-{kind}-img-"))
            .tempdir_in(scratch_root())?;
        let root = dir.path().canonicalize()?;
        let moved = root.join("fs.img");
        let mount_point = root.join("mnt");
        fs::create_dir(&mount_point)?;
        fs::rename(image, &moved).or_else(|_| {
            // Another filesystem: copy, then remove the original.
            fs::copy(image, &moved).and_then(|_| fs::remove_file(image))
        })?;
        let fs = LoopFs {
            kind,
            dir: Some(dir),
            image: moved,
            device: PathBuf::new(),
            mount_point,
            mount_options: options.to_owned(),
            attached: false,
            mounted: false,
        };
        fs.attach_and_mount()
    }

    /// Attaches the image to a free loop device and mounts it. On an error
    /// the value is dropped, which undoes whichever of the two was done.
    fn attach_and_mount(mut self) -> io::Result<LoopFs> {
        let out = run(Command::new(program("losetup")?)
            .args(["--find", "--show"])
            .arg(&self.image))?;
        let device = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        if device.is_empty() {
            return Err(io::Error::other("losetup --find --show printed no device"));
        }
        self.device = PathBuf::from(device);
        self.attached = true;
        self.mount()?;
        Ok(self)
    }

    /// Unmounts the filesystem and detaches its loop device, keeping the
    /// image: for a tool that needs the device unused (`btrfs check`), or to
    /// boot a guest on it. [`LoopFs::remount`] attaches nothing again; drop
    /// or [`LoopFs::close`] still delete the image.
    ///
    /// A mount namespace another process made while this was mounted holds
    /// a copy of the mount (`unshare -m` copies every mount), so unmounting
    /// here does not end the filesystem: what it had not yet written would
    /// reach the image only when that namespace goes, after a caller copied
    /// the image. Hence the sync first, and the wait until the loop device
    /// is really released (at most 30 s), after which nothing writes the
    /// image again.
    pub fn unmount(&mut self) -> io::Result<()> {
        if self.mounted {
            let root = File::open(&self.mount_point)?;
            rustix::fs::syncfs(&root)?;
            drop(root);
            unmount_retrying(&self.mount_point)?;
            self.mounted = false;
        }
        if self.attached {
            run(Command::new(program("losetup")?)
                .arg("-d")
                .arg(&self.device))?;
            self.attached = false;
            wait_released(&self.device, &self.image)?;
        }
        Ok(())
    }

    /// The filesystem's kind.
    pub fn kind(&self) -> FsKind {
        self.kind
    }

    /// Where the filesystem is mounted.
    pub fn mount_point(&self) -> &Path {
        &self.mount_point
    }

    /// `mount_point().join(relative)`.
    pub fn path(&self, relative: impl AsRef<Path>) -> PathBuf {
        self.mount_point.join(relative)
    }

    /// The loop device, e.g. `/dev/loop3`.
    pub fn device(&self) -> &Path {
        &self.device
    }

    /// The backing image file.
    pub fn image_path(&self) -> &Path {
        &self.image
    }

    /// The mount options in use, comma-separated (empty for the defaults).
    pub fn mount_options(&self) -> &str {
        &self.mount_options
    }

    /// Unmounts and mounts the filesystem again, so that what a test then reads
    /// comes from what was committed to the device rather than from in-memory state.
    pub fn remount(&mut self) -> io::Result<()> {
        if self.mounted {
            rustix::mount::unmount(&self.mount_point, UnmountFlags::empty()).map_err(|err| {
                io::Error::other(format!("umount {}: {err}", self.mount_point.display()))
            })?;
            self.mounted = false;
        }
        self.mount()
    }

    /// Tears the filesystem down now, reporting any problem instead of printing it.
    pub fn close(mut self) -> io::Result<()> {
        self.teardown()
    }

    fn mount(&mut self) -> io::Result<()> {
        let mut cmd = Command::new(program("mount")?);
        cmd.arg("-t").arg(self.kind.fs_type());
        if !self.mount_options.is_empty() {
            cmd.arg("-o").arg(&self.mount_options);
        }
        run(cmd.arg(&self.device).arg(&self.mount_point))?;
        self.mounted = true;
        Ok(())
    }

    fn teardown(&mut self) -> io::Result<()> {
        let mut problems = Vec::new();
        if self.mounted {
            match unmount_retrying(&self.mount_point) {
                Ok(()) => self.mounted = false,
                Err(err) => {
                    // Removing the temp dir now would recurse into the still-mounted
                    // filesystem, so leak the directory rather than risk that.
                    if let Some(dir) = self.dir.take() {
                        let _ = dir.keep();
                    }
                    problems.push(format!("umount {}: {err}", self.mount_point.display()));
                }
            }
        }
        if self.attached {
            // On a device still in use (lazy unmount), LOOP_CLR_FD only sets autoclear
            // and succeeds: the kernel detaches it once the last user goes away.
            let detached = program("losetup")
                .and_then(|losetup| run(Command::new(losetup).arg("-d").arg(&self.device)));
            match detached {
                Ok(_) => self.attached = false,
                Err(err) => problems.push(err.to_string()),
            }
        }
        if let Some(dir) = self.dir.take() {
            let path = dir.path().to_path_buf();
            if let Err(err) = dir.close() {
                problems.push(format!("removing {}: {err}", path.display()));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(io::Error::other(problems.join("; ")))
        }
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        if let Err(err) = self.teardown() {
            eprintln!(
                "warning: tearing down {} at {}: {err}",
                self.kind,
                self.mount_point.display()
            );
        }
    }
}

/// Unmounts `target`, waiting a little for transient users (a process still exiting,
/// an fd about to close) before falling back to a lazy unmount, which detaches the
/// mount from the namespace at once and frees it when the last user lets go.
fn unmount_retrying(target: &Path) -> io::Result<()> {
    const ATTEMPTS: u32 = 10;
    for attempt in 0..ATTEMPTS {
        match rustix::mount::unmount(target, UnmountFlags::empty()) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::BUSY) if attempt + 1 < ATTEMPTS => {
                // About one second in all before giving up on a clean unmount.
                thread::sleep(Duration::from_millis(10 << attempt.min(4)));
            }
            Err(rustix::io::Errno::BUSY) => break,
            Err(err) => return Err(err.into()),
        }
    }
    eprintln!(
        "warning: {} still busy, unmounting lazily",
        target.display()
    );
    rustix::mount::unmount(target, UnmountFlags::DETACH).map_err(io::Error::from)
}

/// Waits until loop `device` no longer holds `image`: `losetup -d` of a
/// device whose filesystem another mount namespace still holds only marks
/// it to be freed when that namespace lets go.
fn wait_released(device: &Path, image: &Path) -> io::Result<()> {
    let name = device
        .file_name()
        .ok_or_else(|| io::Error::other(format!("{} names no device", device.display())))?;
    let backing = Path::new("/sys/block").join(name).join("loop/backing_file");
    let wanted = image.as_os_str().as_bytes();
    for _ in 0..3000 {
        match fs::read(&backing) {
            Ok(b) if b.strip_suffix(b"\n").unwrap_or(&b) == wanted => {
                thread::sleep(Duration::from_millis(10))
            }
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::other(format!(
        "{} still holds {} 30 s after it was detached: another mount namespace holds its \
         filesystem",
        device.display(),
        image.display()
    )))
}

/// Whether something is mounted exactly at `path`, according to `/proc/self/mounts`.
pub fn is_mounted(path: &Path) -> io::Result<bool> {
    let mounts = fs::read("/proc/self/mounts")?;
    let wanted = path.as_os_str().as_bytes();
    Ok(mounts
        .split(|&b| b == b'\n')
        .filter_map(|line| line.split(|&b| b == b' ').nth(1))
        .any(|field| unescape_mount_field(field) == wanted))
}

/// Undoes the octal escapes (`\040` for a space, ...) that the kernel applies to
/// whitespace and backslashes in `/proc/self/mounts` fields.
fn unescape_mount_field(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        // Escapes encode one byte, so the first of the three digits is at most 3.
        let octal = field.get(i + 1..i + 4).filter(|d| {
            (b'0'..=b'3').contains(&d[0]) && d[1..].iter().all(|c| (b'0'..=b'7').contains(c))
        });
        match (field[i], octal) {
            (b'\\', Some(d)) => {
                out.push(((d[0] - b'0') << 6) | ((d[1] - b'0') << 3) | (d[2] - b'0'));
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_mount_fields() {
        assert_eq!(unescape_mount_field(br"/a\040b\134c"), b"/a b\\c");
        assert_eq!(unescape_mount_field(br"/plain\09"), br"/plain\09");
    }
}
