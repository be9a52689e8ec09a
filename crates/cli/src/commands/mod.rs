//! One module per subcommand.

pub mod agent;
#[cfg(feature = "bench")]
pub mod bench;
pub mod crypt;
pub mod doctor;
pub mod inspect;
pub mod key;
pub mod pcr;
pub mod recovery;
pub mod rekey;
pub mod watch;
