//! Under upstream's wiring, boot maintenance's result is matched only for
//! `Err`: a package whose conversion failed is returned in
//! `BootMaintenance::failed`, which that call site drops. So each failure
//! must also reach the log where it happens, naming the package and the
//! step. This file holds one test because it installs the process-wide log
//! subscriber: boot maintenance logs from tokio's blocking threads, which a
//! thread-local subscriber would not see.

mod common;

use std::fs;
use std::io::Write;
use std::sync::{Arc, Mutex};

use common::*;
use integration::{LoopFs, fs_or_skip};
use startos_core::volume::{BootProgress, boot_volume_maintenance_at};

/// What the log subscriber wrote, shared with the test.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("log buffer poisoned"))?
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log buffer")).into_owned()
    }
}

fn is_subvolume(path: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).is_ok_and(|m| m.is_dir() && m.ino() == 256)
}

struct Quiet;
impl BootProgress for Quiet {
    fn set_total(&mut self, _: u64) {}
    fn set_done(&mut self, _: u64) {}
}

/// One package holds a mount, which no conversion crosses: it fails, the
/// log line names it and the step, and the others convert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_package_that_cannot_convert_is_logged_and_the_others_convert() {
    let log = Captured::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .init();

    let fs = fs_or_skip!(LoopFs::btrfs(BTRFS_SIZE));
    let root = volumes_root(&fs);
    for p in ["alpha", "held", "omega"] {
        let data = root.join(p).join("data/main");
        fs::create_dir_all(&data).unwrap();
        fs::write(data.join("db"), format!("{p}'s data")).unwrap();
    }
    let _mount = MountGuard::tmpfs(&root.join("held/data/main/mnt"));

    let ids = ["alpha", "held", "omega"];
    let report = boot_volume_maintenance_at(&root, &ids, &ids, &mut Quiet)
        .await
        .expect("only an unreadable root is an error");

    eprintln!(
        "ready {:?} failed {:?}\nlog:\n{}",
        report.ready,
        report.failed,
        log.text()
    );
    let failed: Vec<&str> = report.failed.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(failed, ["held"], "{:?}", report.failed);
    for p in ["alpha", "omega"] {
        assert!(is_subvolume(&root.join(p)), "{p} must convert");
        assert_eq!(
            fs::read_to_string(root.join(p).join("data/main/db")).unwrap(),
            format!("{p}'s data")
        );
    }
    assert!(!is_subvolume(&root.join("held")), "held stays as it was");
    assert_eq!(
        fs::read_to_string(root.join("held/data/main/db")).unwrap(),
        "held's data"
    );

    let text = log.text();
    let line = text
        .lines()
        .find(|l| l.contains("ERROR") && l.contains("held"))
        .unwrap_or_else(|| panic!("no error line names the package; the log:\n{text}"));
    assert!(line.contains("conversion"), "the step: {line}");
    assert!(line.contains("mnt"), "the cause names the mount: {line}");
    assert!(
        !text
            .lines()
            .any(|l| l.contains("ERROR") && (l.contains("alpha") || l.contains("omega"))),
        "only the failing package is logged as failed:\n{text}"
    );
    if let Some(c) = report.cleanup {
        c.await.unwrap().unwrap();
    }
}
