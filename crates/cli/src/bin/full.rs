//! `tpmcrypt-full`: every command (see [`tpmcrypt::main_full`]).

fn main() {
    tpmcrypt::main_full()
}
