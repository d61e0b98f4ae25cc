//! `docs/upstream.md` shows the files start-core's wiring changes; the
//! fixture crate `fixtures/upstream-call-sites` builds upstream's call sites
//! against exactly those files. This checks the page quotes them word for
//! word, and that its line counts are theirs: the wiring's, and, counted
//! apart, the optional readiness step's and each of the reorder's edits.

use std::path::Path;

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

const FIXTURE: &str = "fixtures/upstream-call-sites/src";

/// Asserts the page holds `text` as a rust block, word for word; returns
/// its line count.
fn quoted_lines(page: &str, text: &str, what: &str) -> usize {
    let quoted = format!("```rust\n{text}```");
    assert!(
        page.contains(&quoted),
        "docs/upstream.md must quote {what} as a rust block, word for word"
    );
    text.lines().count()
}

#[test]
fn the_page_quotes_the_wiring_the_fixture_builds() {
    let page = read("docs/upstream.md");
    let mut lines = 0;
    for file in ["volume.rs", "error_from.rs", "btrfs.rs"] {
        let text = read(&format!("{FIXTURE}/start_core/{file}"));
        lines += quoted_lines(&page, &text, &format!("{FIXTURE}/start_core/{file}"));
    }
    // The two call sites in service/mod.rs that convert a restore's result.
    let service = read(&format!("{FIXTURE}/service/mod.rs"));
    let converted = service.matches(".map_err(Error::from)").count();
    assert_eq!(converted, 2, "the fixture's changed call sites");
    lines += converted;
    assert!(
        lines <= 40,
        "the start-core diff outside Cargo files: {lines} lines"
    );
    assert!(
        page.contains(&format!("**{lines} lines** added or changed")),
        "docs/upstream.md must state the count, {lines}"
    );
}

/// The lines of `context/rpc.rs` between the fixture's readiness markers,
/// without the indentation of the method they sit in.
fn rpc_readiness_lines(rpc: &str) -> String {
    let begin = rpc
        .find("// readiness step: begin\n")
        .expect("the readiness begin marker in context/rpc.rs");
    let end = rpc
        .find("// readiness step: end\n")
        .expect("the readiness end marker in context/rpc.rs");
    let region = &rpc[rpc[begin..].find('\n').unwrap() + begin + 1..end];
    let region = &region[..region.rfind('\n').unwrap() + 1];
    let indent = region
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .unwrap_or(0);
    region
        .lines()
        .map(|l| format!("{}\n", l.get(indent..).unwrap_or("")))
        .collect()
}

#[test]
fn the_page_quotes_the_optional_readiness_step_and_counts_it_apart() {
    let page = read("docs/upstream.md");
    let module = read(&format!("{FIXTURE}/start_core/readiness.rs"));
    let mut lines = quoted_lines(&page, &module, "start_core/readiness.rs");
    let rpc = rpc_readiness_lines(&read(&format!("{FIXTURE}/context/rpc.rs")));
    lines += quoted_lines(&page, &rpc, "the marked lines of context/rpc.rs");
    // `pub mod start_when_ready;` in service/mod.rs.
    let service = read(&format!("{FIXTURE}/service/mod.rs"));
    assert!(service.contains("pub mod start_when_ready;"));
    lines += 1;
    assert!(
        page.contains(&format!("**{lines} lines** for the optional step")),
        "docs/upstream.md must state the optional step's count, {lines}"
    );
}

/// Each region of `text` between `// <marker>: begin` and `// <marker>: end`,
/// without the indentation it sits at.
fn marked_regions(text: &str, marker: &str) -> Vec<String> {
    let (begin, end) = (format!("// {marker}: begin"), format!("// {marker}: end"));
    let mut regions = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in text.lines() {
        if line.trim() == begin {
            assert!(current.is_none(), "{marker}: nested begin");
            current = Some(Vec::new());
        } else if line.trim() == end {
            regions.push(current.take().expect("an end without a begin"));
        } else if let Some(lines) = current.as_mut() {
            lines.push(line);
        }
    }
    assert!(current.is_none(), "{marker}: a begin without an end");
    regions
        .into_iter()
        .map(|lines| {
            let indent = lines
                .iter()
                .filter(|l| !l.trim().is_empty())
                .map(|l| l.len() - l.trim_start().len())
                .min()
                .unwrap_or(0);
            lines
                .iter()
                .map(|l| format!("{}\n", l.get(indent..).unwrap_or("")))
                .collect()
        })
        .collect()
}

#[test]
fn the_page_quotes_each_edit_of_the_reorder_and_counts_it_apart() {
    let page = read("docs/upstream.md");
    let reordered = read(&format!("{FIXTURE}/service/reordered.rs"));
    let mut total = 0;
    for n in 1..=6 {
        let regions = marked_regions(&reordered, &format!("reorder {n}"));
        assert!(!regions.is_empty(), "edit {n} is marked");
        let mut lines = 0;
        for region in &regions {
            lines += quoted_lines(&page, region, &format!("reorder {n}'s marked lines"));
        }
        assert!(
            page.contains(&format!("**Edit {n}** ({lines} lines)")),
            "docs/upstream.md must state edit {n}'s count, {lines}"
        );
        total += lines;
    }
    assert!(
        page.contains(&format!("**{total} lines** for the reorder")),
        "docs/upstream.md must state the reorder's count, {total}"
    );
}
