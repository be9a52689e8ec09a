//! One module per subcommand.

pub mod agent;
#[cfg(feature = "bench")]
pub mod bench;
pub mod crypt;
pub mod inspect;
pub mod key;
pub mod pcr;
pub mod recovery;
pub mod watch;
