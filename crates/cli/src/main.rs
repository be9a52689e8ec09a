//! `tpmcrypt`: see [`tpmcrypt::front`].

fn main() {
    tpmcrypt::front::main()
}
