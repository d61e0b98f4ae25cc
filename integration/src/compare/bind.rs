//! (e) A restore while another mount namespace holds a bind mount of the
//! volume and writes to it, as a dependent package's container holds a
//! dependency's volume.
//!
//! The volume has a backup. A process started with `unshare --mount
//! --propagation private` bind-mounts `<root>/<pkg>/data/main` in its own
//! namespace (invisible to ours) and appends a numbered line to `log` in
//! it every few milliseconds, printing each number once written. Then the
//! restore runs, and the writer goes on for a while. Where did the writes
//! made after the restore returned land: in the volume at the path, in some
//! other tree under the root, or nowhere (a deleted tree)? Ours restores
//! too, and keeps the replaced volume, which the mount still shows, under
//! `<pkg>.held` while the mount exists, naming the writer; once the writer
//! has stopped, the next operation (a `resolve_pending`) reclaims it.

use std::collections::BTreeSet;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::trees;
use super::{Backups, Context, Report, Result, Row, Side, block_on};

/// How long the writer goes on after the restore returned.
const WRITE_ON: Duration = Duration::from_millis(300);

/// One side's run.
#[derive(Clone, Debug)]
pub struct BindOutcome {
    /// Whether the restore went through.
    pub restored: bool,
    /// Why it did not, if it did not.
    pub refusal: Option<String>,
    /// Lines the writer wrote after the restore returned.
    pub writes_after: usize,
    /// Of those, the ones found in no tree under the root once the writer
    /// was gone.
    pub lost_after: usize,
    /// Of those, the ones found in the volume at its path.
    pub in_volume: usize,
    /// Of those, the ones found in the tree kept while mounted (ours).
    pub in_held: usize,
    /// Ours: whether the restore's outcome named the writer (its pid and
    /// mount point) as the holder of the replaced volume it kept.
    pub holder_named: Option<bool>,
    /// Appends that failed, as the writer saw them.
    pub write_errors: usize,
    /// Ours: whether the next operation, once the writer had stopped,
    /// reclaimed the kept tree.
    pub reclaimed_after_stop: Option<bool>,
    /// The restore call.
    pub time: Duration,
}

/// Both sides' runs.
#[derive(Clone, Debug)]
pub struct BindComparison {
    /// Upstream's baseline.
    pub upstream: BindOutcome,
    /// Ours.
    pub ours: BindOutcome,
}

/// The writer: a process in its own mount namespace, appending to a file
/// in its bind mount of the volume; killed on drop.
struct Writer {
    child: Child,
    lines: Arc<Mutex<Vec<(u64, Instant)>>>,
    errors: Arc<Mutex<usize>>,
    reader: Option<JoinHandle<()>>,
    stopped: bool,
}

impl Writer {
    fn start(source: &Path, target: &Path) -> Result<Writer> {
        fs::create_dir_all(target).ctx("creating the bind mount point")?;
        const SCRIPT: &str = r#"mount --bind "$1" "$2" || exit 1
echo ready
i=0
while :; do
  i=$((i+1))
  if echo "$i" >> "$2/log"; then echo "$i"; else echo "err $i"; fi
  sleep 0.005
done"#;
        let mut child = Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                SCRIPT,
                "sh",
            ])
            .arg(source)
            .arg(target)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ctx("starting the writer with unshare")?;
        let stdout = child.stdout.take().ok_or("the writer has no stdout")?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let errors = Arc::new(Mutex::new(0));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let reader = {
            let lines = Arc::clone(&lines);
            let errors = Arc::clone(&errors);
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    let line = line.trim();
                    if line == "ready" {
                        let _ = ready_tx.send(());
                    } else if let Ok(n) = line.parse::<u64>() {
                        lock(&lines).push((n, Instant::now()));
                    } else if line.starts_with("err") {
                        *lock(&errors) += 1;
                    }
                }
            })
        };
        let mut w = Writer {
            child,
            lines,
            errors,
            reader: Some(reader),
            stopped: false,
        };
        if ready_rx.recv_timeout(Duration::from_secs(10)).is_err() {
            w.stop();
            return Err("the writer could not bind-mount the volume".into());
        }
        Ok(w)
    }

    /// Lines written so far.
    fn written(&self) -> usize {
        lock(&self.lines).len()
    }

    /// Waits until at least `n` lines are written.
    fn wait_for(&self, n: usize) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.written() < n {
            if Instant::now() > deadline {
                return Err("the writer stopped writing".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Kills it (its namespace, and so its mount, go with it) and collects
    /// what it printed.
    fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        // Its last `sleep` may outlive it by a few milliseconds, holding
        // the namespace.
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Every number in every file named `log` under `root`.
fn numbers_under(root: &Path) -> Result<[BTreeSet<u64>; 3]> {
    let mut anywhere = BTreeSet::new();
    let mut in_volume = BTreeSet::new();
    let mut in_held = BTreeSet::new();
    for p in trees::walk(root)? {
        if p.file_name().is_some_and(|n| n == "log") && p.is_file() {
            let text = fs::read_to_string(&p).ctx(format!("reading {}", p.display()))?;
            let nums = text.lines().filter_map(|l| l.trim().parse::<u64>().ok());
            let at_path = p.starts_with(root.join("app"));
            let held = p.starts_with(root.join("app.held"));
            for n in nums {
                anywhere.insert(n);
                if at_path {
                    in_volume.insert(n);
                }
                if held {
                    in_held.insert(n);
                }
            }
        }
    }
    Ok([anywhere, in_volume, in_held])
}

/// Runs the scenario on one filesystem, each side under its own root.
pub fn run(scale: &super::Scale) -> Result<BindComparison> {
    let (fs, _) = super::scratch(scale)?;
    let run_side = |side: Side| -> Result<BindOutcome> {
        let root = fs.path(side.to_string());
        fs::create_dir(&root).ctx("creating a volumes root")?;
        side_run(side, &root, &fs.path(format!("container-{side}")))
            .ctx(format!("{side}'s restore under a bind mount"))
    };
    Ok(BindComparison {
        upstream: run_side(Side::Upstream)?,
        ours: run_side(Side::Ours)?,
    })
}

fn side_run(side: Side, root: &Path, target: &Path) -> Result<BindOutcome> {
    let pkg = "app";
    let live = root.join(pkg);
    let backups = Backups::new(root, pkg);
    let (theirs, ours) = (&backups.theirs, &backups.ours);
    backups.ensure_volume_root(side, root, pkg)?;
    fs::create_dir_all(live.join("data/main")).ctx("mkdir data/main")?;
    fs::write(live.join("data/main/log"), b"0\n").ctx("writing the log")?;
    let taken = backups.begin_and_snapshot(side)?;
    if !taken {
        return Err("no backup was taken".into());
    }

    let mut writer = Writer::start(&live.join("data/main"), target)?;
    writer.wait_for(10)?;
    let pid = writer.child.id();
    let started = Instant::now();
    let (result, holder_named) = match side {
        Side::Upstream => (theirs.restore().map_err(|e| e.to_string()), None),
        Side::Ours => match block_on(ours.restore_outcome()) {
            Ok(o) => {
                let named = o.held.is_some_and(|h| {
                    h.holders
                        .iter()
                        .any(|u| u.pid == pid && u.mount_point == target)
                });
                (Ok(()), Some(named))
            }
            Err(e) => (Err(e.to_string()), Some(false)),
        },
    };
    let returned = Instant::now();
    let time = returned - started;
    let before_stop = writer.written();
    std::thread::sleep(WRITE_ON);
    writer.wait_for(before_stop + 10)?;
    writer.stop();
    let after: Vec<u64> = lock(&writer.lines)
        .iter()
        .filter(|(_, at)| *at > returned)
        .map(|(n, _)| *n)
        .collect();
    let write_errors = *lock(&writer.errors);
    drop(writer);

    let [anywhere, in_volume, in_held] = numbers_under(root)?;
    let reclaimed_after_stop = match side {
        Side::Ours => Some(
            block_on(ours.resolve_pending()).is_ok() && !root.join(format!("{pkg}.held")).exists(),
        ),
        Side::Upstream => None,
    };
    let count = |set: &BTreeSet<u64>| after.iter().filter(|n| set.contains(n)).count();
    Ok(BindOutcome {
        restored: result.is_ok(),
        refusal: result.err(),
        writes_after: after.len(),
        lost_after: after.len() - count(&anywhere),
        in_volume: count(&in_volume),
        in_held: count(&in_held),
        holder_named,
        write_errors,
        reclaimed_after_stop,
        time,
    })
}

fn restore_cell(o: &BindOutcome) -> String {
    match (&o.refusal, o.holder_named) {
        (None, None) => "restored while the mount was held".into(),
        (None, Some(named)) => format!(
            "restored while the mount was held; replaced volume kept{}",
            if named {
                " (names the pid and mount)"
            } else {
                ", holder NOT named"
            }
        ),
        (Some(e), _) => format!("failed: {e}"),
    }
}

fn writes_cell(o: &BindOutcome) -> String {
    let mut s = if o.lost_after == 0 {
        let kept = match o.reclaimed_after_stop {
            None => String::new(),
            Some(r) => format!(
                ", {} in the kept tree{}",
                o.in_held,
                if r {
                    ", reclaimed once it stopped"
                } else {
                    ", NOT reclaimed once it stopped"
                }
            ),
        };
        format!(
            "{} writes after it: all kept, {} in the volume{kept}",
            o.writes_after, o.in_volume
        )
    } else {
        format!(
            "{} writes after it: {} LOST (went to the deleted old tree), {} in the volume",
            o.writes_after, o.lost_after, o.in_volume
        )
    };
    if o.write_errors > 0 {
        s.push_str(&format!("; {} failed", o.write_errors));
    }
    s
}

impl Report for BindComparison {
    fn rows(&self) -> Vec<Row> {
        let (u, o) = (&self.upstream, &self.ours);
        vec![
            Row::new(
                "e. restore under a writing bind mount",
                restore_cell(u),
                restore_cell(o),
            )
            .timed(u.time, o.time),
            Row::new("  the writer's data", writes_cell(u), writes_cell(o)),
        ]
    }
}
