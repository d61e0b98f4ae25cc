//! What the two command-line tools (`startos-volume`, `volume-migrate`)
//! share in how they answer a caller: a usage error as one line, and a
//! failure as a JSON object. Here, in the crate both already depend on with
//! their `cli` feature, rather than in each binary, so that the two say the
//! same thing the same way. Prints only; changes nothing on disk.

use std::process::ExitCode;

use models::Error;

/// Parses this process's arguments as `P`. `--help` and `--version` print
/// as clap prints them, and give `Err(ExitCode::SUCCESS)`; any other
/// parse error is one line on stderr, `<program>: <what was wrong>`
/// ([`usage_error_line`]), and `Err(2)`, the exit code of bad usage.
pub fn parse_args<P: clap::Parser>(program: &str) -> Result<P, ExitCode> {
    match P::try_parse() {
        Ok(p) => Ok(p),
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            Err(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("{program}: {}", usage_error_line(&e));
            Err(ExitCode::from(2))
        }
    }
}

/// clap's error as one line: what was wrong, with what clap adds to it
/// (the value it expected, a tip), without the usage and the pointer to
/// `--help` it prints after. clap's own text spreads over four lines or
/// more; its first alone may not name what was wrong ("the following
/// required arguments were not provided:", the argument on the next).
pub fn usage_error_line(e: &clap::Error) -> String {
    let text = e.to_string();
    let text = text.strip_prefix("error: ").unwrap_or(&text);
    let parts: Vec<String> = text
        .split("\n\n")
        .filter(|p| {
            let p = p.trim_start();
            !p.is_empty() && !p.starts_with("Usage:") && !p.starts_with("For more information")
        })
        .map(|p| {
            p.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    match parts.is_empty() {
        true => "bad arguments; see --help".to_owned(),
        false => parts.join("; "),
    }
}

/// A failure as the tools print it on stdout with `--json`: its message
/// (the one line also on stderr), and its kind's title and upstream's
/// numeric code, `{"error", "kind", "code"}`.
pub fn error_json(e: &Error) -> serde_json::Value {
    serde_json::json!({
        "error": e.to_string(),
        "kind": e.kind.as_str(),
        "code": e.kind.code(),
    })
}
