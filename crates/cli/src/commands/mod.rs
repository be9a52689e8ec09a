//! One module per subcommand.

pub mod bench;
pub mod crypt;
pub mod inspect;
pub mod recovery;
pub mod watch;
