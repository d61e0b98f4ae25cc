//! `docs/upstream.md` shows the files start-core's wiring changes; the
//! fixture crate `fixtures/upstream-call-sites` builds upstream's call sites
//! against exactly those files. This checks the page quotes them word for
//! word, and that its line count is theirs.

use std::path::Path;

fn read(rel: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

#[test]
fn the_page_quotes_the_wiring_the_fixture_builds() {
    let page = read("docs/upstream.md");
    let mut lines = 0;
    for file in ["volume.rs", "error_from.rs", "btrfs.rs"] {
        let text = read(&format!(
            "fixtures/upstream-call-sites/src/start_core/{file}"
        ));
        let quoted = format!("```rust\n{text}```");
        assert!(
            page.contains(&quoted),
            "docs/upstream.md must quote fixtures/.../start_core/{file} as a rust block, word for word"
        );
        lines += text.lines().count();
    }
    // The two call sites in service/mod.rs that convert a restore's result.
    let fixture = read("fixtures/upstream-call-sites/src/lib.rs");
    let converted = fixture.matches(".map_err(Error::from)").count();
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
