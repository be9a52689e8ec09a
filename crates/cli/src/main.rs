//! `tpmcrypt`: see [`tpmcrypt_cli::front`].

fn main() {
    tpmcrypt_cli::front::main()
}
