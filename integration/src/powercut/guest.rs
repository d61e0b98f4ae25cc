//! The guest: Debian's cloud kernel, a busybox initramfs holding the
//! project's binaries, and QEMU under TCG to run one command on a disk.
//!
//! [`GuestKit::prepare`] fetches what it needs with Debian's own tools
//! (`apt-get download`, `dpkg -x`) into a cache directory, once, and
//! builds the initramfs from it and the given binaries on every call (they
//! change with every build). [`run`] boots it on a disk image, either
//! logged (QEMU's `blklogwrites` driver writes every request to a
//! dm-log-writes log) or direct (`cache.direct=on`, for real cuts by
//! SIGKILL).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::dist::STATIC_TARGET;
use crate::run as run_cmd;

/// Debian's meta-package whose dependency names the current cloud kernel.
pub const KERNEL_META: &str = "linux-image-cloud-amd64";
/// Debian's static busybox.
pub const BUSYBOX_PACKAGE: &str = "busybox-static";
/// The modules the guest loads (with their dependencies, from modules.dep).
pub const MODULES: &[&str] = &["virtio_pci", "virtio_blk", "btrfs"];
const INIT: &str = include_str!("init.sh");

/// A bootable guest: kernel image and initramfs.
#[derive(Debug, Clone)]
pub struct GuestKit {
    /// The kernel image (`vmlinuz`).
    pub kernel: PathBuf,
    /// The initramfs (an uncompressed newc cpio archive).
    pub initramfs: PathBuf,
    /// The kernel's release, e.g. `6.1.0-57-cloud-amd64`.
    pub release: String,
    /// The QEMU binary.
    pub qemu: PathBuf,
}

fn err(what: impl Into<String>) -> io::Error {
    io::Error::other(what.into())
}

fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|c| c.is_file())
}

/// The unpacked package under `cache/<dir>`, fetched and unpacked first if
/// missing. `package` is resolved by `resolve` only when it must be fetched.
fn unpacked(
    cache: &Path,
    dir: &str,
    resolve: &dyn Fn() -> io::Result<String>,
) -> io::Result<PathBuf> {
    let target = cache.join(dir);
    if target.join(".complete").exists() {
        return Ok(target);
    }
    let package = resolve()?;
    let debs = cache.join("debs");
    fs::create_dir_all(&debs)?;
    let download = || {
        run_cmd(
            Command::new("apt-get")
                .arg("download")
                .arg(&package)
                .current_dir(&debs),
        )
    };
    if download().is_err() {
        // Stale or missing package lists: refresh once, then retry.
        run_cmd(Command::new("apt-get").args(["update", "-qq"]))?;
        download()?;
    }
    let deb = fs::read_dir(&debs)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&format!("{package}_")) && n.ends_with(".deb"))
        })
        .ok_or_else(|| {
            err(format!(
                "apt-get download {package} left no .deb in {}",
                debs.display()
            ))
        })?;
    let tmp = cache.join(format!("{dir}.tmp"));
    if tmp.exists() {
        fs::remove_dir_all(&tmp)?;
    }
    run_cmd(Command::new("dpkg").arg("-x").arg(&deb).arg(&tmp))?;
    fs::write(tmp.join(".complete"), package.as_bytes())?;
    if target.exists() {
        fs::remove_dir_all(&target)?;
    }
    fs::rename(&tmp, &target)?;
    fs::remove_file(&deb)?;
    Ok(target)
}

/// The cloud kernel package the meta-package depends on today.
fn kernel_package() -> io::Result<String> {
    let out = run_cmd(Command::new("apt-cache").args(["depends", KERNEL_META]))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-cloud-amd64"))
        .map(str::to_owned)
        .ok_or_else(|| {
            err(format!(
                "`apt-cache depends {KERNEL_META}` names no cloud kernel"
            ))
        })
}

/// The modules to load, dependencies first, as paths relative to the
/// release's module directory, from its `modules.dep`.
fn module_order(moddir: &Path, wanted: &[&str]) -> io::Result<Vec<String>> {
    let dep = fs::read_to_string(moddir.join("modules.dep"))?;
    let mut deps: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut by_name: BTreeMap<String, String> = BTreeMap::new();
    for line in dep.lines() {
        let Some((module, rest)) = line.split_once(':') else {
            continue;
        };
        let name = Path::new(module)
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.split('.').next())
            .unwrap_or_default()
            .replace('-', "_");
        by_name.insert(name, module.to_owned());
        deps.insert(
            module.to_owned(),
            rest.split_whitespace().map(str::to_owned).collect(),
        );
    }
    fn visit(
        m: &str,
        deps: &BTreeMap<String, Vec<String>>,
        seen: &mut BTreeSet<String>,
        out: &mut Vec<String>,
    ) {
        if !seen.insert(m.to_owned()) {
            return;
        }
        for d in deps.get(m).into_iter().flatten() {
            visit(d, deps, seen, out);
        }
        out.push(m.to_owned());
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for w in wanted {
        let m = by_name.get(&w.replace('-', "_")).ok_or_else(|| {
            err(format!(
                "module {w} is not in {}/modules.dep",
                moddir.display()
            ))
        })?;
        visit(m, &deps, &mut seen, &mut out);
    }
    Ok(out)
}

/// Whether the ELF image `bytes` names a program interpreter (a
/// `PT_INTERP` program header): a dynamically linked binary, which would
/// need the host's loader and libraries in the guest. A static binary,
/// static-pie included, has none. `None` if `bytes` is not a 64-bit
/// little-endian ELF image whose program headers lie inside it.
fn names_interpreter(bytes: &[u8]) -> Option<bool> {
    const PT_INTERP: u32 = 3;
    let u16_at = |o: usize| Some(u16::from_le_bytes(bytes.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(bytes.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(bytes.get(o..o + 8)?.try_into().ok()?));
    // ELF magic, ELFCLASS64, ELFDATA2LSB.
    if bytes.get(..6)? != b"\x7fELF\x02\x01" {
        return None;
    }
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    if phentsize < 4 {
        return None;
    }
    for i in 0..phnum {
        let at = phoff.checked_add(i.checked_mul(phentsize)?)?;
        if u32_at(at)? == PT_INTERP {
            return Some(true);
        }
    }
    Some(false)
}

/// A newc cpio archive being written: what the kernel unpacks as its
/// initramfs.
struct Cpio<W: Write> {
    out: W,
    ino: u32,
    dirs: BTreeSet<PathBuf>,
}

impl<W: Write> Cpio<W> {
    fn header(&mut self, name: &str, mode: u32, size: usize) -> io::Result<()> {
        self.ino += 1;
        let namesize = name.len() + 1;
        let fields = [
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            u32::try_from(size).map_err(|_| err(format!("{name} is too large for cpio")))?,
            0,
            0,
            0,
            0,
            u32::try_from(namesize).map_err(|_| err("name too long"))?,
            0,
        ];
        let mut h = String::from("070701");
        for f in fields {
            h.push_str(&format!("{f:08x}"));
        }
        self.out.write_all(h.as_bytes())?;
        self.out.write_all(name.as_bytes())?;
        self.out.write_all(&[0])?;
        self.pad(110 + namesize)
    }

    fn pad(&mut self, len: usize) -> io::Result<()> {
        let pad = (4 - len % 4) % 4;
        self.out.write_all(&[0u8; 3][..pad])
    }

    /// Adds the directory `path` and its parents, once each.
    fn dir(&mut self, path: &Path) -> io::Result<()> {
        if path.as_os_str().is_empty() || self.dirs.contains(path) {
            return Ok(());
        }
        if let Some(parent) = path.parent() {
            self.dir(parent)?;
        }
        self.dirs.insert(path.to_owned());
        let name = path.to_string_lossy().into_owned();
        self.header(&name, 0o040755, 0)
    }

    /// Adds a regular file at `path` (relative, e.g. `bin/busybox`).
    fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        if let Some(parent) = Path::new(path).parent() {
            self.dir(parent)?;
        }
        self.header(path, 0o100000 | mode, data.len())?;
        self.out.write_all(data)?;
        self.pad(data.len())
    }

    fn finish(mut self) -> io::Result<W> {
        self.header("TRAILER!!!", 0, 0)?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Removes the initramfs files earlier test processes left in `cache`
/// (each is named by its process id) once that process is gone.
fn remove_stale_initramfs(cache: &Path) -> io::Result<()> {
    for e in fs::read_dir(cache)? {
        let path = e?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let pid = name
            .strip_prefix("initramfs-")
            .and_then(|n| n.split('.').next())
            .and_then(|n| n.parse::<u32>().ok());
        if let Some(pid) = pid
            && pid != std::process::id()
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            fs::remove_file(&path)?;
        }
    }
    Ok(())
}

/// The bytes of `bin` as the guest gets it: stripped of debug information
/// when `strip` is there (a debug build is mostly that), else as it is.
fn binary_bytes(bin: &Path, scratch: &Path) -> io::Result<Vec<u8>> {
    if let Some(strip) = find_program("strip") {
        let out = scratch.join("stripped");
        if Command::new(strip)
            .arg("--strip-debug")
            .arg("-o")
            .arg(&out)
            .arg(bin)
            .status()
            .is_ok_and(|s| s.success())
        {
            let bytes = fs::read(&out)?;
            fs::remove_file(&out)?;
            return Ok(bytes);
        }
    }
    fs::read(bin).map_err(|e| err(format!("{}: {e}", bin.display())))
}

impl GuestKit {
    /// Prepares the guest under `cache`: the kernel and busybox packages
    /// (fetched and unpacked once), then an initramfs with busybox, the
    /// modules in [`MODULES`] and their dependencies, `binaries` under
    /// `/bin` (static ones only: nothing of the host's is copied in), and
    /// the init script.
    ///
    /// Any failure is an error saying what is missing: the caller fails
    /// the test under `CI=true`.
    pub fn prepare(cache: &Path, binaries: &[PathBuf]) -> io::Result<GuestKit> {
        let qemu = find_program("qemu-system-x86_64")
            .ok_or_else(|| err("qemu-system-x86_64 not found (run `make deps`)"))?;
        for tool in ["apt-get", "apt-cache", "dpkg"] {
            find_program(tool).ok_or_else(|| err(format!("`{tool}` not found")))?;
        }
        fs::create_dir_all(cache)?;
        let kernel_root = unpacked(cache, "kernel", &kernel_package)?;
        let busybox_root = unpacked(cache, "busybox", &|| Ok(BUSYBOX_PACKAGE.to_owned()))?;
        let busybox = busybox_root.join("bin/busybox");
        let modules = kernel_root.join("lib/modules");
        let release = fs::read_dir(&modules)?
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .next()
            .ok_or_else(|| err(format!("no kernel release under {}", modules.display())))?;
        let kernel = kernel_root.join(format!("boot/vmlinuz-{release}"));
        if !kernel.is_file() {
            return Err(err(format!("{} is missing", kernel.display())));
        }
        let moddir = modules.join(&release);
        if !moddir.join("modules.dep").exists() {
            // Debian builds modules.dep at install time; busybox's depmod
            // makes it here.
            run_cmd(
                Command::new(&busybox)
                    .arg("depmod")
                    .arg("-b")
                    .arg(&kernel_root)
                    .arg(&release),
            )?;
        }
        let order = module_order(&moddir, MODULES)?;

        remove_stale_initramfs(cache)?;
        let initramfs = cache.join(format!("initramfs-{}.cpio", std::process::id()));
        let tmp = initramfs.with_extension("tmp");
        let file = fs::File::create(&tmp)?;
        let mut cpio = Cpio {
            out: io::BufWriter::new(file),
            ino: 0,
            dirs: BTreeSet::new(),
        };
        for d in ["dev", "proc", "sys", "run", "tmp", "mnt", "etc"] {
            cpio.dir(Path::new(d))?;
        }
        cpio.file("init", 0o755, INIT.as_bytes())?;
        cpio.file("bin/busybox", 0o755, &fs::read(&busybox)?)?;
        let mut names = String::new();
        for m in &order {
            let base = Path::new(m)
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| err(format!("bad module path {m}")))?;
            cpio.file(
                &format!("lib/modules/{base}"),
                0o644,
                &fs::read(moddir.join(m))?,
            )?;
            names.push_str(base);
            names.push('\n');
        }
        cpio.file("etc/modules.order", 0o644, names.as_bytes())?;
        for bin in binaries {
            let name = bin
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| err(format!("bad binary path {}", bin.display())))?;
            let bytes = binary_bytes(bin, cache)?;
            // Static binaries only, as an OS image takes them: nothing of
            // the host's is copied in, so the guest runs exactly what ships.
            match names_interpreter(&bytes) {
                Some(false) => {}
                Some(true) => {
                    return Err(err(format!(
                        "{} is dynamically linked; the guest takes static binaries \
                         (`make dist`, and the workload built for {STATIC_TARGET})",
                        bin.display()
                    )));
                }
                None => return Err(err(format!("{} is not a 64-bit ELF binary", bin.display()))),
            }
            cpio.file(&format!("bin/{name}"), 0o755, &bytes)?;
        }
        cpio.finish()?;
        fs::rename(&tmp, &initramfs)?;
        fs::set_permissions(&initramfs, fs::Permissions::from_mode(0o644))?;
        Ok(GuestKit {
            kernel,
            initramfs,
            release,
            qemu,
        })
    }
}

/// How the guest's disk is attached.
#[derive(Debug, Clone)]
pub enum Disk {
    /// Through QEMU's `blklogwrites` driver, every request logged to the
    /// file given (created empty first).
    Logged(PathBuf),
    /// Straight to the image, `cache.direct=on` with the guest told the
    /// disk has a write cache: every write the guest saw complete is in
    /// the image file, so a SIGKILL of QEMU is a power cut.
    Direct,
}

/// What a guest run did.
#[derive(Debug, Clone)]
pub struct RunResult {
    /// Every `PC-` line of the serial console, in order.
    pub lines: Vec<String>,
    /// The command's exit status, if it finished.
    pub rc: Option<i32>,
    /// Whether the guest unmounted the disk and powered off.
    pub completed: bool,
    /// Whether it was killed (the cut).
    pub killed: bool,
    /// From the command's start (as the host saw the `PC-GO` line) to its
    /// end, or to the kill.
    pub workload: Option<Duration>,
    /// The whole run, boot included.
    pub total: Duration,
}

impl RunResult {
    /// The command's output lines (the guest prefixes them `PC-OUT `).
    pub fn output(&self) -> String {
        self.lines
            .iter()
            .filter_map(|l| l.strip_prefix("PC-OUT "))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Boots `kit` with `image` as its disk and runs `command` (its words
/// must hold no comma or space) on it, mounted at `/mnt`. With `kill_after`,
/// SIGKILLs QEMU that long after the command started (the guest printed
/// `PC-GO`), unless it ended first. Gives up after `timeout`.
pub fn run(
    kit: &GuestKit,
    image: &Path,
    disk: &Disk,
    command: &[&str],
    kill_after: Option<Duration>,
    timeout: Duration,
) -> io::Result<RunResult> {
    if let Some(w) = command
        .iter()
        .find(|w| w.contains([',', ' ']) || w.is_empty())
    {
        return Err(err(format!(
            "guest command word {w:?} is empty or holds a comma or space"
        )));
    }
    let mut cmd = Command::new(&kit.qemu);
    cmd.args([
        "-machine",
        "q35,accel=tcg",
        "-cpu",
        "max",
        "-m",
        "512",
        "-smp",
        "1",
    ])
    .args(["-display", "none", "-monitor", "none", "-serial", "stdio"])
    .args(["-nic", "none", "-no-reboot"])
    .arg("-kernel")
    .arg(&kit.kernel)
    .arg("-initrd")
    .arg(&kit.initramfs)
    .arg("-append")
    .arg(format!(
        "console=ttyS0 quiet panic=-1 pc.run={}",
        command.join(",")
    ));
    let img = image.display();
    match disk {
        Disk::Logged(log) => {
            fs::File::create(log)?;
            cmd.arg("-blockdev")
                .arg(format!("driver=file,filename={img},node-name=data"))
                .arg("-blockdev")
                .arg(format!(
                    "driver=file,filename={},node-name=logfile",
                    log.display()
                ))
                .arg("-blockdev")
                .arg(
                    "driver=blklogwrites,node-name=disk,file=data,log=logfile,\
                     log-append=off,log-sector-size=512",
                );
        }
        Disk::Direct => {
            cmd.arg("-blockdev").arg(format!(
                "driver=file,filename={img},node-name=disk,cache.direct=on"
            ));
        }
    }
    cmd.args(["-device", "virtio-blk-pci,drive=disk,write-cache=on"]);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| err(format!("cannot start {}: {e}", kit.qemu.display())))?;
    let stdout = child.stdout.take().ok_or_else(|| err("qemu: no stdout"))?;
    let stderr = child.stderr.take().ok_or_else(|| err("qemu: no stderr"))?;
    let (tx, rx) = mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        let mut r = BufReader::new(stdout);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&buf);
                    let line = line.trim_end_matches(['\r', '\n']);
                    if let Some(at) = line.find("PC-")
                        && tx.send(line[at..].to_owned()).is_err()
                    {
                        break;
                    }
                }
            }
        }
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = io::Read::read_to_string(&mut BufReader::new(stderr), &mut s);
        s
    });
    let mut result = RunResult {
        lines: Vec::new(),
        rc: None,
        completed: false,
        killed: false,
        workload: None,
        total: Duration::ZERO,
    };
    let mut go: Option<Instant> = None;
    let deadline = started + timeout;
    loop {
        let now = Instant::now();
        let kill_at = go.zip(kill_after).map(|(g, k)| g + k);
        if let Some(k) = kill_at.filter(|&k| k <= now) {
            let _ = child.kill();
            result.killed = true;
            result.workload = Some(k.max(now) - go.unwrap_or(k));
            break;
        }
        if now >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(err(format!(
                "the guest ran over {timeout:?}; its lines: {:?}",
                result.lines
            )));
        }
        let wait = kill_at.unwrap_or(deadline).min(deadline) - now;
        match rx.recv_timeout(wait) {
            Ok(line) => {
                if line.starts_with("PC-GO") {
                    go = Some(Instant::now());
                } else if let Some(rest) = line.strip_prefix("PC-RC ") {
                    result.rc = rest.split_whitespace().next().and_then(|s| s.parse().ok());
                    result.workload = go.map(|g| g.elapsed());
                } else if line == "PC-END" {
                    result.completed = true;
                }
                result.lines.push(line);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let status = child.wait()?;
    let _ = reader.join();
    let stderr = err_reader.join().unwrap_or_default();
    result.total = started.elapsed();
    if !result.killed && !status.success() {
        return Err(err(format!(
            "qemu exited with {status}: {}",
            stderr.trim_end()
        )));
    }
    if let Some(fail) = result.lines.iter().find(|l| l.starts_with("PC-FAIL")) {
        return Err(err(format!("the guest failed: {fail}")));
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::names_interpreter;

    #[test]
    fn a_dynamic_binary_names_its_interpreter() {
        let exe = std::env::current_exe().expect("this test's binary");
        let bytes = std::fs::read(&exe).expect("reading it");
        assert_eq!(names_interpreter(&bytes), Some(true), "{}", exe.display());
    }

    #[test]
    fn malformed_images_are_no_verdict() {
        assert_eq!(names_interpreter(b""), None);
        assert_eq!(names_interpreter(b"#!/bin/sh\n"), None);
        // 32-bit class.
        assert_eq!(names_interpreter(b"\x7fELF\x01\x01\0\0"), None);
        // A 64-bit header cut before its program-header fields.
        assert_eq!(names_interpreter(b"\x7fELF\x02\x01\0\0\0\0"), None);
        // Program headers said to lie past the end.
        let mut h = vec![0u8; 64];
        h[..6].copy_from_slice(b"\x7fELF\x02\x01");
        h[0x20..0x28].copy_from_slice(&1000u64.to_le_bytes());
        h[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        h[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        assert_eq!(names_interpreter(&h), None);
        // No program headers at all: nothing names an interpreter.
        h[0x38..0x3a].copy_from_slice(&0u16.to_le_bytes());
        assert_eq!(names_interpreter(&h), Some(false));
        // One PT_INTERP header inside the image.
        h.resize(64 + 56, 0);
        h[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        h[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        h[64..68].copy_from_slice(&3u32.to_le_bytes());
        assert_eq!(names_interpreter(&h), Some(true));
    }
}
