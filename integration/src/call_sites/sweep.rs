//! The SIGKILL sweep over an update, in either order, and what each kill
//! leaves once the box rebooted.

use std::path::Path;

use super::{Box_, Ended, Failure, Order, Run, arm, boot, install};

/// The update swept: one that succeeds (v1 to v2) or one whose new
/// version's init fails after writing into the volume, so it is rolled
/// back (at the crash's reboot too: its init fails again there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// v1 to v2, which succeeds.
    Update,
    /// v1 to v2, whose init fails: undone through `Service::load`.
    Rollback,
}

/// The package after a kill and a reboot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Its old version, running, on its old data alone.
    Old,
    /// Its new version, running, on its new data, the old kept in it.
    New,
    /// Anything else: a version on another's data, a lost file, a state
    /// left, a stray name; what was found.
    Mix(String),
}

/// One sweep: the kill points an order reached in a flow, and each one's
/// outcome after the reboot.
#[derive(Debug, Clone)]
pub struct Swept {
    /// The call sites swept.
    pub order: Order,
    /// The update swept.
    pub flow: Flow,
    /// Each kill point reached, in sweep order, with its outcome.
    pub outcomes: Vec<(String, Outcome)>,
}

impl Swept {
    /// The kill points that ended in a mix, with what was found.
    pub fn mixes(&self) -> Vec<(&str, &str)> {
        self.outcomes
            .iter()
            .filter_map(|(fp, o)| match o {
                Outcome::Mix(what) => Some((fp.as_str(), what.as_str())),
                _ => None,
            })
            .collect()
    }
}

const ID: &str = "app";

/// The volume store's failpoints (every `failpoint("..")` under
/// `volume/src`, read from the sources so a new one is swept too), then
/// the fixture's kill points (`call-sites kill-points`).
pub fn kill_points(bin: &Path) -> Result<Vec<String>, Failure> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../volume/src");
    let mut store = std::collections::BTreeSet::new();
    let mut dirs = vec![root];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        for path in entries.flatten().map(|e| e.path()) {
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                for part in text.split("failpoint(\"").skip(1) {
                    if let Some((name, _)) = part.split_once('"') {
                        store.insert(name.to_owned());
                    }
                }
            }
        }
    }
    let out = std::process::Command::new(bin)
        .arg("kill-points")
        .output()
        .map_err(|e| format!("call-sites kill-points: {e}"))?;
    let fixture = String::from_utf8_lossy(&out.stdout);
    let mut all: Vec<String> = store.into_iter().collect();
    all.extend(fixture.lines().map(str::to_owned));
    if all.len() < 20 {
        return Err(format!("too few kill points: {all:?}"));
    }
    Ok(all)
}

/// Kills `order`'s `flow` at each of `points` (a box each, made under
/// `dir` by `make_box`), reboots, and classifies what the package came
/// back as. Kill points the flow never reaches are left out.
pub fn sweep(
    make_box: &dyn Fn(&str) -> Result<Box_, Failure>,
    order: Order,
    flow: Flow,
    points: &[String],
) -> Result<Swept, Failure> {
    let fail = (flow == Flow::Rollback).then_some("init");
    let mut outcomes = Vec::new();
    for (i, fp) in points.iter().enumerate() {
        let b = make_box(&format!("{order:?}-{flow:?}-{i}"))?;
        let setup = b.completed(&[order.step(), boot(), install(ID, "1", None)])?;
        if !setup.ok() {
            return Err(format!("setup: {:?}\n{}", setup.steps, setup.stderr));
        }
        let killed = b.run(&[order.step(), boot(), arm(fp), install(ID, "2", fail)])?;
        let Ended::Killed(_) = killed else {
            continue;
        };
        let run = b.completed(&[order.step(), boot()])?;
        outcomes.push((fp.clone(), classify(&b, &run, flow)));
    }
    Ok(Swept {
        order,
        flow,
        outcomes,
    })
}

/// What the package came back as. A backup beside an `Installed` package
/// is not a stray name: upstream's protocol keeps it until the next
/// `begin` (a crash between the commit and `remove`).
pub fn classify(b: &Box_, run: &Run, flow: Flow) -> Outcome {
    let installed = run.installed(ID);
    let has = |v: &str| b.main(ID).join(format!("data-{v}")).exists();
    let data = std::fs::read_to_string(b.main(ID).join("version")).ok();
    let names = b.names(ID);
    let found = format!(
        "installed {installed:?}, running {:?}, data version {data:?}, data-1 {}, data-2 {}, names {names:?}",
        run.running.get(ID),
        has("1"),
        has("2"),
    );
    let stray = names
        .iter()
        .any(|n| n != ID && *n != format!("{ID}.install-backup"));
    if stray || run.running.get(ID) != installed.as_ref() || run.loads_failed(ID) {
        return Outcome::Mix(found);
    }
    match installed.as_deref() {
        Some("1") if data.as_deref() == Some("1") && has("1") && !has("2") => Outcome::Old,
        Some("2")
            if flow == Flow::Update && data.as_deref() == Some("2") && has("1") && has("2") =>
        {
            Outcome::New
        }
        _ => Outcome::Mix(found),
    }
}

impl Run {
    /// Whether a load of `id` returned an error.
    pub fn loads_failed(&self, id: &str) -> bool {
        self.events
            .iter()
            .filter_map(|e| e.get("load"))
            .any(|l| l["id"] == id && !l["error"].is_null())
    }
}
