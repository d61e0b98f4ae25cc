//! The comparison table: one row per measured fact, four columns, each
//! wrapped to fit a 100-column terminal.

use std::time::Duration;

pub use crate::fmt::{fmt_bytes, fmt_count, fmt_duration};

/// One row of the table. The first row of a scenario names it; the rest
/// carry a short indented label in the first column.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Row {
    /// The scenario, or what this row of it measures.
    pub scenario: String,
    /// Upstream's outcome.
    pub upstream: String,
    /// Ours.
    pub ours: String,
    /// How long each took, `upstream / ours`, if timed.
    pub times: String,
}

impl Row {
    /// A row without times.
    pub fn new(
        scenario: impl Into<String>,
        upstream: impl Into<String>,
        ours: impl Into<String>,
    ) -> Row {
        Row {
            scenario: scenario.into(),
            upstream: upstream.into(),
            ours: ours.into(),
            times: String::new(),
        }
    }

    /// The same row with `upstream / ours` in the times column.
    pub fn timed(mut self, upstream: Duration, ours: Duration) -> Row {
        self.times = format!("{} / {}", fmt_duration(upstream), fmt_duration(ours));
        self
    }

    /// The same row with `text` in the times column.
    pub fn times(mut self, text: impl Into<String>) -> Row {
        self.times = text.into();
        self
    }
}

/// Column widths: scenario, upstream, ours, times; with two spaces between
/// columns the table is 99 characters wide.
const WIDTHS: [usize; 4] = [18, 29, 29, 17];

/// The table of `groups` (one per scenario, separated by a rule), with a
/// header.
pub fn render(groups: &[Vec<Row>]) -> String {
    let mut out = String::new();
    let header = Row {
        scenario: "scenario".into(),
        upstream: "upstream".into(),
        ours: "ours".into(),
        times: "time up / ours".into(),
    };
    let width = WIDTHS.iter().sum::<usize>() + 2 * (WIDTHS.len() - 1);
    push_row(&mut out, &header);
    out.push_str(&"=".repeat(width));
    out.push('\n');
    for (i, group) in groups.iter().enumerate() {
        if i > 0 {
            out.push_str(&"-".repeat(width));
            out.push('\n');
        }
        for row in group {
            push_row(&mut out, row);
        }
    }
    out
}

fn push_row(out: &mut String, row: &Row) {
    let cells: Vec<Vec<String>> = [&row.scenario, &row.upstream, &row.ours, &row.times]
        .iter()
        .zip(WIDTHS)
        .map(|(text, w)| wrap(text, w))
        .collect();
    let lines = cells.iter().map(Vec::len).max().unwrap_or(1);
    for i in 0..lines {
        let mut line = String::new();
        for (c, (cell, w)) in cells.iter().zip(WIDTHS).enumerate() {
            let text = cell.get(i).map_or("", String::as_str);
            if c > 0 {
                line.push_str("  ");
            }
            line.push_str(text);
            line.extend(std::iter::repeat_n(
                ' ',
                w.saturating_sub(text.chars().count()),
            ));
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// `text` split into lines of at most `width` characters, at spaces where
/// possible (a longer word is cut), keeping a leading indent on the first
/// line.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let indent: String = text.chars().take_while(|c| *c == ' ').collect();
    let mut line = indent.clone();
    // Whether `line` holds a word yet (then the next one needs a space).
    let mut started = false;
    for word in text.split_whitespace() {
        let mut word = word.to_owned();
        loop {
            let len = line.chars().count();
            let sep = usize::from(started);
            if len + sep + word.chars().count() <= width {
                if started {
                    line.push(' ');
                }
                line.push_str(&word);
                started = true;
                break;
            }
            if started {
                lines.push(std::mem::take(&mut line));
                started = false;
                continue;
            }
            // A word longer than the column: cut it.
            let room = width.saturating_sub(len).max(1);
            let head: String = word.chars().take(room).collect();
            let rest: String = word.chars().skip(room).collect();
            line.push_str(&head);
            lines.push(std::mem::take(&mut line));
            word = rest;
        }
    }
    if started || lines.is_empty() {
        lines.push(line);
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps_at_spaces_and_cuts_long_words() {
        assert_eq!(wrap("one two three", 7), ["one two", "three"]);
        assert_eq!(wrap("abcdefghij", 4), ["abcd", "efgh", "ij"]);
        assert_eq!(wrap("", 4), [""]);
        assert_eq!(wrap("  kill points", 8), ["  kill", "points"]);
        assert_eq!(wrap("  ready, one by one", 10), ["  ready,", "one by one"]);
    }

    #[test]
    fn every_line_fits() {
        let rows = vec![vec![
            Row::new(
                "a. a scenario with a long name",
                "a long outcome ".repeat(9),
                "x".repeat(70),
            )
            .timed(Duration::from_millis(1500), Duration::from_micros(80)),
        ]];
        for line in render(&rows).lines() {
            assert!(line.chars().count() <= 100, "{line:?}");
        }
    }
}
