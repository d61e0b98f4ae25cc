//! A stand-in package service for tests and the demo: writes random blocks
//! into its volume like a database until SIGTERM. See
//! `integration::services::service_main`.

fn main() -> std::process::ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    match integration::services::service_main(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("startos-core-service: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
