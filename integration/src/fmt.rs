//! How the benches, the demo and the comparison print figures: one function
//! per kind of figure, so that a table and the README quoting it agree.

use std::time::Duration;

/// `12.3 s`, `3.41 s`, `521 ms`, `4.2 ms`, `850 us`: three significant
/// figures down to the millisecond.
pub fn fmt_duration(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 10.0 {
        format!("{s:.1} s")
    } else if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 0.1 {
        format!("{:.0} ms", s * 1e3)
    } else if s >= 0.001 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.0} us", s * 1e6)
    }
}

/// `812x`, `3.4x`.
pub fn fmt_ratio(ratio: f64) -> String {
    if ratio >= 10.0 {
        format!("{ratio:.0}x")
    } else {
        format!("{ratio:.1}x")
    }
}

/// `515,321`.
pub fn fmt_count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `3.0 GiB`: sizes as the tools print them ([`volume::human_bytes`]).
pub use volume::human_bytes as fmt_bytes;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_read_as_the_readme_quotes_them() {
        assert_eq!(fmt_duration(Duration::from_millis(12_345)), "12.3 s");
        assert_eq!(fmt_duration(Duration::from_millis(3_410)), "3.41 s");
        assert_eq!(fmt_duration(Duration::from_millis(521)), "521 ms");
        assert_eq!(fmt_duration(Duration::from_micros(4_200)), "4.2 ms");
        assert_eq!(fmt_duration(Duration::from_micros(850)), "850 us");
        assert_eq!(fmt_ratio(812.4), "812x");
        assert_eq!(fmt_ratio(3.41), "3.4x");
        assert_eq!(fmt_count(515_321), "515,321");
        assert_eq!(fmt_count(999), "999");
        assert_eq!(fmt_bytes(3 << 30), "3.0 GiB");
    }
}
