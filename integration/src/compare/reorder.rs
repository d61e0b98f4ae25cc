//! (h) Start-core's own call sites (`fixtures/upstream-call-sites`), an
//! update and an update rolled back, killed by SIGKILL at every step
//! (each store failpoint inside the volume calls, each kill point of the
//! fixture's stand-ins between them), then rebooted: in upstream's order,
//! and with the reorder's edits. Both sides run on `startos_core::volume`:
//! what differs is the order of the call sites alone. Each kill point
//! reached ends with the package on its old version and data, on its new
//! version and data, or a mix; the rows count the mixes and name where.
//!
//! It runs the `call-sites` binary, which must be built (with
//! `startos-core/failpoints`) beside the program running this.

use super::{Context, Report, Result, Row, Scale};
use crate::call_sites::sweep::{Flow, Swept, kill_points, sweep};
use crate::call_sites::{Box_, Order};

/// Both orders' sweeps of both flows.
#[derive(Clone, Debug)]
pub struct ReorderComparison {
    /// Upstream's order: the update's sweep, then the rollback's.
    pub upstream: [Swept; 2],
    /// With the reorder's edits.
    pub ours: [Swept; 2],
}

/// Sweeps both flows in both orders, a box per kill point on one
/// filesystem.
pub fn run(scale: &Scale) -> Result<ReorderComparison> {
    let (fs, _) = super::scratch(scale)?;
    let bin = crate::workspace_bin("call-sites")?;
    let points = kill_points(&bin)?;
    let make_box = |name: &str| -> std::result::Result<Box_, String> {
        let data = fs.path(name);
        std::fs::create_dir_all(&data).map_err(|e| format!("{}: {e}", data.display()))?;
        Ok(Box_ {
            bin: bin.clone(),
            data,
        })
    };
    let both = |order: Order| -> Result<[Swept; 2]> {
        Ok([
            sweep(&make_box, order, Flow::Update, &points).ctx("sweeping an update")?,
            sweep(&make_box, order, Flow::Rollback, &points).ctx("sweeping a rollback")?,
        ])
    };
    Ok(ReorderComparison {
        upstream: both(Order::Upstream)?,
        ours: both(Order::Reordered)?,
    })
}

fn cell(s: &Swept) -> String {
    format!(
        "{} of {} kill points a mix",
        s.mixes().len(),
        s.outcomes.len()
    )
}

fn names(s: &Swept) -> String {
    let names: Vec<&str> = s.mixes().into_iter().map(|(fp, _)| fp).collect();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

impl Report for ReorderComparison {
    fn rows(&self) -> Vec<Row> {
        let (u, o) = (&self.upstream, &self.ours);
        vec![
            Row::new(
                "h. call sites, SIGKILL at each step",
                "upstream's order",
                "reordered",
            ),
            Row::new("  update", cell(&u[0]), cell(&o[0])),
            Row::new("  its mixes", names(&u[0]), names(&o[0])),
            Row::new("  rollback", cell(&u[1]), cell(&o[1])),
            Row::new("  its mixes", names(&u[1]), names(&o[1])),
        ]
    }
}
