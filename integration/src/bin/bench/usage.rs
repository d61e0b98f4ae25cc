//! The `usage` section (issue 3): our space accounting of one volume against
//! `compsize` and `btrfs filesystem du`, each run as a whole process, on the
//! fixture's two subvolumes (about 100k small files; one file of about 500k
//! extents).
//!
//! Ours is `startos-volume --root R usage PKG --json`, the release binary next
//! to this one: one TREE_SEARCH_V2 sweep of the subvolume's tree, its key
//! ranges shared out among threads. compsize
//! walks the directory tree and searches each file's extent items;
//! `btrfs filesystem du` walks it and calls FIEMAP on every file.
//!
//! Warm: each tool runs once untimed, then `runs` times back to back. Cold:
//! `sync; echo 3 > /proc/sys/vm/drop_caches` (untimed) before every timed
//! run, the tools taking turns, so each starts with nothing cached: not the
//! filesystem's metadata, not its own binary. Every run's figures, ours and
//! compsize's (`-b`, exact bytes), are compared, and each run's CPU time
//! (user + system, from `getrusage(RUSAGE_CHILDREN)`) is reported beside
//! its wall time.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::common::{Result, fmt_bytes, fmt_count, fmt_duration, fmt_ratio, timed};
use crate::fixture::{Fixture, Tree, TreeKind};
use crate::{Stats, Verdict, drop_caches, sibling_binary};

/// On many files, ours must be at least this much faster than compsize,
/// warm.
const COMPSIZE_WARM_TARGET: f64 = 5.0;
/// ... and cold.
const COMPSIZE_COLD_TARGET: f64 = 3.0;
/// On one file, ours must use at most this many times compsize's CPU time,
/// warm and cold. Both tools then read the same items through the same
/// ioctl, one file's extent items in key order, so their wall times measure
/// the kernel's search, not either tool: the target is on what each does
/// with the items, its own CPU time.
const COMPSIZE_ONE_FILE_CPU_TARGET: f64 = 1.2;
/// Ours must be at least this much faster than `btrfs filesystem du`, warm and cold.
const DU_TARGET: f64 = 10.0;

/// The three ways to measure a volume.
#[derive(Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Tool {
    /// `startos-volume --root R usage PKG --json`.
    Ours,
    /// `compsize -b <volume>`.
    Compsize,
    /// `btrfs filesystem du -s <volume>`.
    BtrfsDu,
}

impl Tool {
    const ALL: [Tool; 3] = [Tool::Ours, Tool::Compsize, Tool::BtrfsDu];

    fn name(self) -> &'static str {
        match self {
            Tool::Ours => "ours (startos-volume usage)",
            Tool::Compsize => "compsize -b",
            Tool::BtrfsDu => "btrfs filesystem du -s",
        }
    }
}

/// compsize's three byte figures.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bytes {
    disk: u64,
    uncompressed: u64,
    referenced: u64,
}

/// Everything compsize prints, and what ours reports for the same tree.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Figures {
    files: u64,
    extents: u64,
    refs: u64,
    inline: u64,
    total: Bytes,
    by_type: BTreeMap<String, Bytes>,
}

/// `compsize -b` output: "Processed N files, N regular extents (N refs), N
/// inline." and one row per type (`TOTAL` and each compression type) of
/// percentage, disk, uncompressed and referenced bytes.
fn parse_compsize(text: &str) -> Result<Figures> {
    let bad = |line: &str| format!("unexpected compsize output line {line:?}");
    let mut f = Figures::default();
    let mut counts = false;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("Processed ") {
            let nums = rest
                .split(|c: char| !c.is_ascii_digit())
                .filter(|s| !s.is_empty())
                .map(str::parse)
                .collect::<Result<Vec<u64>, _>>()
                .map_err(|_| bad(line))?;
            let [files, extents, refs, inline] = nums[..] else {
                return Err(bad(line).into());
            };
            (f.files, f.extents, f.refs, f.inline) = (files, extents, refs, inline);
            counts = true;
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.len() != 5 || words[0] == "Type" {
            continue;
        }
        let num = |s: &str| s.parse::<u64>().map_err(|_| bad(line));
        let b = Bytes {
            disk: num(words[2])?,
            uncompressed: num(words[3])?,
            referenced: num(words[4])?,
        };
        if words[0] == "TOTAL" {
            f.total = b;
        } else {
            f.by_type.insert(words[0].to_owned(), b);
        }
    }
    if !counts {
        return Err(format!("compsize printed no counts: {:?}", text.trim()).into());
    }
    Ok(f)
}

/// `startos-volume usage --json`: the live volume's figures.
fn parse_ours(text: &str) -> Result<Figures> {
    #[derive(Deserialize)]
    struct Out {
        volume: Option<Figures>,
    }
    let out: Out = serde_json::from_str(text)
        .map_err(|e| format!("startos-volume usage --json printed no usage: {e}"))?;
    out.volume
        .ok_or_else(|| "startos-volume usage --json reported no volume".into())
}

/// Warm and cold timings of one tool on one tree.
#[derive(Serialize)]
pub struct ToolRow {
    tool: Tool,
    warm: Stats,
    cold: Stats,
    /// CPU time (user + system, every thread) of the warm runs...
    warm_cpu: Stats,
    /// ... and of the cold runs: against the wall time, how busy the
    /// machine's cores kept the tool.
    cold_cpu: Stats,
    /// This tool's warm median over ours.
    warm_vs_ours: f64,
    /// This tool's cold median over ours.
    cold_vs_ours: f64,
}

/// Everything measured on one tree.
#[derive(Serialize)]
pub struct Case {
    tree: String,
    /// File data bytes in the tree.
    bytes: u64,
    /// Our figures (from the first run).
    ours: Figures,
    /// compsize's, when they differ from ours in any run.
    #[serde(skip_serializing_if = "Option::is_none")]
    compsize: Option<Figures>,
    figures_identical: bool,
    rows: Vec<ToolRow>,
    /// The subvolume's b-tree: what a cold run of ours must read.
    tree_blocks: TreeBlocks,
    /// A database's volume (one file, or an LMDB environment's data file
    /// and its 8 KiB lock file): the one-file targets apply.
    #[serde(skip)]
    one_file: bool,
}

/// Blocks of a subvolume's b-tree, as `btrfs inspect-internal dump-tree`
/// lists them.
#[derive(Serialize)]
pub struct TreeBlocks {
    leaves: u64,
    nodes: u64,
    /// Both together, in bytes.
    bytes: u64,
}

/// Counts the blocks of the tree of the subvolume at `path` on `device`
/// (read from the device: the filesystem is synced first).
fn tree_blocks(device: &Path, path: &Path) -> Result<TreeBlocks> {
    rustix::fs::sync();
    let out = integration::run(
        Command::new("btrfs")
            .args(["inspect-internal", "rootid"])
            .arg(path),
    )?;
    let id = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let super_block = integration::run(
        Command::new("btrfs")
            .args(["inspect-internal", "dump-super"])
            .arg(device),
    )?;
    let nodesize = String::from_utf8_lossy(&super_block.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("nodesize")?.trim().parse::<u64>().ok())
        .ok_or("dump-super printed no nodesize")?;
    let mut child = Command::new("btrfs")
        .args(["inspect-internal", "dump-tree", "-t", &id])
        .arg(device)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("running btrfs inspect-internal dump-tree: {e}"))?;
    let stdout = child.stdout.take().ok_or("dump-tree: no stdout")?;
    let (mut leaves, mut nodes) = (0, 0);
    for line in std::io::BufRead::split(std::io::BufReader::new(stdout), b'\n') {
        let line = line.map_err(|e| format!("reading dump-tree output: {e}"))?;
        if line.starts_with(b"leaf ") {
            leaves += 1;
        } else if line.starts_with(b"node ") {
            nodes += 1;
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("waiting for dump-tree: {e}"))?;
    if !status.success() || leaves == 0 {
        return Err(format!("btrfs inspect-internal dump-tree -t {id} failed ({status})").into());
    }
    Ok(TreeBlocks {
        leaves,
        nodes,
        bytes: (leaves + nodes) * nodesize,
    })
}

impl Case {
    fn row(&self, tool: Tool) -> &ToolRow {
        &self.rows[tool as usize]
    }
}

/// The section's results.
#[derive(Serialize)]
pub struct Report {
    runs: u32,
    cases: Vec<Case>,
    targets: Vec<Verdict>,
    total_seconds: f64,
}

/// The programs each tool runs.
struct Runner<'a> {
    ours: &'a Path,
    root: &'a Path,
}

impl Runner<'_> {
    /// Runs `tool` on `tree` once, timed from spawn to exit, and returns the
    /// figures it printed (none for `btrfs filesystem du`, whose figures are
    /// of another kind) and the CPU time it used.
    fn run(&self, tool: Tool, tree: &Tree) -> Result<(Option<Figures>, Duration, Duration)> {
        let mut cmd = match tool {
            Tool::Ours => {
                let mut c = Command::new(self.ours);
                c.arg("--root")
                    .arg(self.root)
                    .args(["usage", tree.pkg.as_str(), "--json"]);
                c
            }
            Tool::Compsize => {
                let mut c = Command::new("compsize");
                c.arg("-b").arg(&tree.path);
                c
            }
            Tool::BtrfsDu => {
                let mut c = Command::new("btrfs");
                c.args(["filesystem", "du", "-s"]).arg(&tree.path);
                c
            }
        };
        let cpu_before = children_cpu();
        let (out, took) = timed(|| integration::run(&mut cmd))?;
        let cpu = children_cpu().saturating_sub(cpu_before);
        let text = String::from_utf8_lossy(&out.stdout);
        let figures = match tool {
            Tool::Ours => Some(parse_ours(&text)?),
            Tool::Compsize => Some(parse_compsize(&text)?),
            Tool::BtrfsDu => None,
        };
        Ok((figures, took, cpu))
    }
}

/// User plus system time of every waited-for child process so far.
fn children_cpu() -> Duration {
    cpu(libc::RUSAGE_CHILDREN)
}

/// User plus system time so far of `who` (`RUSAGE_SELF`: this process's
/// threads; `RUSAGE_CHILDREN`: its waited-for children). Kernel threads'
/// work on its behalf (btrfs commits, delayed references) is not counted.
#[allow(unsafe_code)] // getrusage
pub(crate) fn cpu(who: libc::c_int) -> Duration {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the rusage it is given; RUSAGE_SELF and
    // RUSAGE_CHILDREN are valid `who`s, so it cannot fail, and a zeroed
    // rusage is valid anyway.
    let usage = unsafe {
        libc::getrusage(who, usage.as_mut_ptr());
        usage.assume_init()
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Compares every run's figures with the first of each tool.
#[derive(Default)]
struct Check {
    ours: Option<Figures>,
    compsize: Option<Figures>,
    /// Whether some run printed other figures than the tool's first run.
    varied: bool,
}

impl Check {
    fn add(&mut self, tool: Tool, figures: Option<Figures>) {
        let Some(f) = figures else { return };
        let slot = match tool {
            Tool::Ours => &mut self.ours,
            Tool::Compsize => &mut self.compsize,
            Tool::BtrfsDu => return,
        };
        match slot {
            Some(first) => self.varied |= *first != f,
            None => *slot = Some(f),
        }
    }
}

fn measure(runner: &Runner, device: &Path, tree: &Tree, runs: u32) -> Result<Case> {
    let mut check = Check::default();
    // Wall and CPU time of each tool's runs.
    let mut warm: [(Vec<Duration>, Vec<Duration>); 3] = Default::default();
    let mut cold: [(Vec<Duration>, Vec<Duration>); 3] = Default::default();
    for (i, &tool) in Tool::ALL.iter().enumerate() {
        let (figures, ..) = runner.run(tool, tree)?;
        check.add(tool, figures);
        for _ in 0..runs {
            let (figures, took, cpu) = runner.run(tool, tree)?;
            check.add(tool, figures);
            warm[i].0.push(took);
            warm[i].1.push(cpu);
        }
    }
    for _ in 0..runs {
        for (i, &tool) in Tool::ALL.iter().enumerate() {
            drop_caches()?;
            let (figures, took, cpu) = runner.run(tool, tree)?;
            check.add(tool, figures);
            cold[i].0.push(took);
            cold[i].1.push(cpu);
        }
    }
    let ours = check.ours.unwrap_or_default();
    let identical = !check.varied && check.compsize.as_ref() == Some(&ours);
    let ours_warm = Stats::of(&warm[0].0).median;
    let ours_cold = Stats::of(&cold[0].0).median;
    let rows = Tool::ALL
        .iter()
        .zip(warm.iter().zip(&cold))
        .map(|(&tool, ((w, w_cpu), (c, c_cpu)))| {
            let (warm, cold) = (Stats::of(w), Stats::of(c));
            ToolRow {
                tool,
                warm_vs_ours: warm.median / ours_warm,
                cold_vs_ours: cold.median / ours_cold,
                warm,
                cold,
                warm_cpu: Stats::of(w_cpu),
                cold_cpu: Stats::of(c_cpu),
            }
        })
        .collect();
    Ok(Case {
        tree: tree.label.clone(),
        bytes: tree.bytes,
        compsize: if identical { None } else { check.compsize },
        ours,
        figures_identical: identical,
        rows,
        tree_blocks: tree_blocks(device, &tree.path)?,
        one_file: tree.kind == TreeKind::Fragmented,
    })
}

/// Runs the section on the fixture's trees.
pub fn run(fx: &Fixture, runs: u32) -> Result<Report> {
    run_on(&fx.root, fx.device(), &fx.trees, runs)
}

/// Runs the section on `trees`, package volumes under the volumes root
/// `root` on the btrfs on `device` (the `lmdb` section's environment).
pub fn run_on(root: &Path, device: &Path, trees: &[Tree], runs: u32) -> Result<Report> {
    let start = Instant::now();
    let ours = sibling_binary("startos-volume", "-p volume --bin startos-volume")?;
    let runner = Runner { ours: &ours, root };
    let mut cases = Vec::new();
    for tree in trees {
        eprintln!(
            "usage: {}: {runs} warm and {runs} cold runs of each tool ...",
            tree.label
        );
        cases.push(measure(&runner, device, tree, runs)?);
    }
    Ok(Report {
        runs,
        targets: verdicts(&cases),
        cases,
        total_seconds: start.elapsed().as_secs_f64(),
    })
}

fn verdicts(cases: &[Case]) -> Vec<Verdict> {
    let mut out = Vec::new();
    let identical = cases.iter().all(|c| c.figures_identical);
    out.push(Verdict::new(
        "usage: our figures identical to compsize -b".to_owned(),
        identical,
        cases
            .iter()
            .map(|c| {
                let yes = if c.figures_identical { "yes" } else { "no" };
                format!("{} {yes}", c.tree)
            })
            .collect::<Vec<_>>()
            .join(", "),
    ));
    let speedups = |what: &dyn Fn(&Case) -> Vec<(&'static str, f64)>| {
        let mut worst = f64::INFINITY;
        let mut parts = Vec::new();
        for c in cases {
            for (label, ratio) in what(c) {
                worst = worst.min(ratio);
                parts.push(format!("{}{label} {}", c.tree, fmt_ratio(ratio)));
            }
        }
        (worst, parts.join(", "))
    };
    let (one, many): (Vec<&Case>, Vec<&Case>) = cases.iter().partition(|c| c.one_file);
    let on = |set: &[&Case], what: &dyn Fn(&Case) -> f64| -> (f64, String) {
        let worst = set.iter().map(|c| what(c)).fold(f64::INFINITY, f64::min);
        let detail = set
            .iter()
            .map(|c| format!("{} {}", c.tree, fmt_ratio(what(c))))
            .collect::<Vec<_>>()
            .join(", ");
        (worst, detail)
    };
    // The `lmdb` section measures a database's volume alone.
    if !many.is_empty() {
        let (worst, detail) = on(&many, &|c| c.row(Tool::Compsize).warm_vs_ours);
        out.push(Verdict::new(
            format!(
                "usage: on many files, ours >= {COMPSIZE_WARM_TARGET:.0}x faster than compsize, warm"
            ),
            worst >= COMPSIZE_WARM_TARGET,
            detail,
        ));
        let (worst, detail) = on(&many, &|c| c.row(Tool::Compsize).cold_vs_ours);
        out.push(Verdict::new(
            format!(
                "usage: on many files, ours >= {COMPSIZE_COLD_TARGET:.0}x faster than compsize, cold"
            ),
            worst >= COMPSIZE_COLD_TARGET,
            detail,
        ));
    }
    // CPU time of ours over compsize's: at most the target (lower is better).
    let cpu_share = |c: &Case, warm: bool| {
        let (o, t) = (c.row(Tool::Ours), c.row(Tool::Compsize));
        match warm {
            true => o.warm_cpu.median().as_secs_f64() / t.warm_cpu.median().as_secs_f64(),
            false => o.cold_cpu.median().as_secs_f64() / t.cold_cpu.median().as_secs_f64(),
        }
    };
    let (worst_warm, warm_detail) = {
        let worst = one.iter().map(|c| cpu_share(c, true)).fold(0.0, f64::max);
        let detail = one
            .iter()
            .map(|c| format!("{} warm {}", c.tree, fmt_ratio(cpu_share(c, true))))
            .chain(
                one.iter()
                    .map(|c| format!("{} cold {}", c.tree, fmt_ratio(cpu_share(c, false)))),
            )
            .collect::<Vec<_>>()
            .join(", ");
        (worst, detail)
    };
    let worst_cold = one.iter().map(|c| cpu_share(c, false)).fold(0.0, f64::max);
    out.push(Verdict::new(
        format!(
            "usage: on one file, ours uses <= {COMPSIZE_ONE_FILE_CPU_TARGET}x compsize's CPU time, warm and cold"
        ),
        !one.is_empty() && worst_warm.max(worst_cold) <= COMPSIZE_ONE_FILE_CPU_TARGET,
        warm_detail,
    ));
    let (worst, detail) = speedups(&|c| {
        let r = c.row(Tool::BtrfsDu);
        vec![(" warm", r.warm_vs_ours), (" cold", r.cold_vs_ours)]
    });
    out.push(Verdict::new(
        format!("usage: ours >= {DU_TARGET:.0}x faster than btrfs filesystem du"),
        worst >= DU_TARGET,
        detail,
    ));
    out
}

/// The section's table, notes and target lines.
pub fn print(report: &Report) {
    println!(
        "{:<22} {:<28} {:>9} {:>7} {:>8} {:>9} {:>7} {:>8}",
        "usage of one volume",
        "tool (whole process)",
        "warm",
        "/ours",
        "cpu",
        "cold",
        "/ours",
        "cpu"
    );
    for case in &report.cases {
        for (i, row) in case.rows.iter().enumerate() {
            let ratio = |r: f64| {
                if row.tool == Tool::Ours {
                    "-".to_owned()
                } else {
                    fmt_ratio(r)
                }
            };
            println!(
                "{:<22} {:<28} {:>9} {:>7} {:>8} {:>9} {:>7} {:>8}",
                if i == 0 { case.tree.as_str() } else { "" },
                row.tool.name(),
                fmt_duration(row.warm.median()),
                ratio(row.warm_vs_ours),
                fmt_duration(row.warm_cpu.median()),
                fmt_duration(row.cold.median()),
                ratio(row.cold_vs_ours),
                fmt_duration(row.cold_cpu.median()),
            );
        }
        let f = &case.ours;
        println!(
            "{:<22} figures identical to compsize: {} ({} files, {} extents, {} refs, {} inline)",
            "",
            if case.figures_identical { "yes" } else { "no" },
            fmt_count(f.files),
            fmt_count(f.extents),
            fmt_count(f.refs),
            fmt_count(f.inline)
        );
        let t = &case.tree_blocks;
        println!(
            "{:<22} its b-tree: {} leaves and {} nodes, {} (btrfs inspect-internal dump-tree)",
            "",
            fmt_count(t.leaves),
            fmt_count(t.nodes),
            fmt_bytes(t.bytes)
        );
        if let Some(c) = &case.compsize {
            println!("{:<22}   ours:     {f:?}", "");
            println!("{:<22}   compsize: {c:?}", "");
        }
    }
    println!(
        "medians of {} runs; warm: right after a run of the same tool; cold: after\n\
         \x20 `sync; echo 3 > /proc/sys/vm/drop_caches` (untimed), tools taking turns;\n\
         \x20 cpu: the process's user + system time, all its threads (kernel threads\n\
         \x20 reading for it not included)",
        report.runs
    );
    println!();
    for v in &report.targets {
        v.print();
    }
}
