//! The `moeforge` command line; each command lives in `cli/`.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
