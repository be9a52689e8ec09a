//! `tpmcrypt-full`: every command (see [`tpmcrypt_cli::main_full`]).

fn main() {
    tpmcrypt_cli::main_full()
}
