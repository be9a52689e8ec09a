//! Selecting the TPM: TCTI strings in tpm2-tools syntax.
//!
//! We accept the same strings users already know from `TPM2TOOLS_TCTI`
//! (`device:/dev/tpmrm0`, `swtpm:host=127.0.0.1,port=2321`, `mssim:...`,
//! `tabrmd`), validate them ourselves so that typos produce a clear message
//! instead of an opaque tpm2-tss loader failure, and map them to
//! [`tss_esapi::TctiNameConf`].

use std::fmt;
use std::str::FromStr;

use tss_esapi::tcti_ldr::{DeviceConfig, NetworkTPMConfig, TabrmdConfig, TctiNameConf};

use crate::error::{Error, Result};

/// Environment variable that selects the TPM when no `--tcti` is given.
pub const ENV_TCTI: &str = "TPMCRYPT_TCTI";

/// tpm2-tools' variable, honoured after [`ENV_TCTI`] (as tpm2-tools users
/// expect their setting to carry over).
pub const ENV_TPM2TOOLS_TCTI: &str = "TPM2TOOLS_TCTI";

/// tpm2-tss's variable, honoured after [`ENV_TPM2TOOLS_TCTI`].
pub const ENV_TSS2_TCTI: &str = "TSS2_TCTI";

/// The variables that name a TPM, in the order they are honoured.
pub const ENV_CHAIN: [&str; 3] = [ENV_TCTI, ENV_TPM2TOOLS_TCTI, ENV_TSS2_TCTI];

/// Where the TCTI in use came from (for `-v` and diagnostics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TctiSource {
    /// Given by the caller (the CLI's `--tpm`).
    Given,
    /// From this environment variable (one of [`ENV_CHAIN`]).
    Env(&'static str),
    /// Nothing named a TPM: [`DEFAULT_TCTI`].
    Default,
}

impl fmt::Display for TctiSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TctiSource::Given => write!(f, "given"),
            TctiSource::Env(name) => write!(f, "{name}"),
            TctiSource::Default => write!(f, "default"),
        }
    }
}

/// The TCTI the environment names, looked up with `var`: the first of
/// [`ENV_CHAIN`] that is set and not blank, else [`DEFAULT_TCTI`]. A value
/// that does not parse is an error that names its variable (it is not
/// skipped: the user meant a TPM, and another one must not be used).
pub fn choose(var: impl Fn(&str) -> Option<String>) -> Result<(Tcti, TctiSource)> {
    for name in ENV_CHAIN {
        match var(name) {
            Some(v) if !v.trim().is_empty() => {
                let tcti = v.parse().map_err(|e| match e {
                    Error::InvalidInput(why) => Error::InvalidInput(format!("{name}: {why}")),
                    other => other,
                })?;
                return Ok((tcti, TctiSource::Env(name)));
            }
            _ => {}
        }
    }
    Ok((DEFAULT_TCTI.parse()?, TctiSource::Default))
}

/// The TCTI used when nothing is configured: the kernel resource manager,
/// which (unlike `/dev/tpm0`) lets several processes share the TPM.
pub const DEFAULT_TCTI: &str = "device:/dev/tpmrm0";

/// A parsed TCTI specification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tcti {
    /// A character device (`device:/dev/tpmrm0`).
    Device {
        /// The device node.
        path: String,
    },
    /// swtpm's TCP protocol (`swtpm:host=H,port=P`); control port is P+1.
    Swtpm {
        /// Host name or address.
        host: String,
        /// The command port.
        port: u16,
    },
    /// Microsoft/IBM simulator protocol (`mssim:host=H,port=P`).
    Mssim {
        /// Host name or address.
        host: String,
        /// The command port.
        port: u16,
    },
    /// The tpm2-abrmd resource manager over D-Bus; the config is passed on.
    Tabrmd {
        /// The configuration string passed to tpm2-abrmd's TCTI.
        config: String,
    },
}

impl Tcti {
    /// The TCTI from `TPMCRYPT_TCTI`, `TPM2TOOLS_TCTI` or `TSS2_TCTI` (the
    /// first set), or [`DEFAULT_TCTI`].
    pub fn from_env() -> Result<Tcti> {
        Tcti::from_env_with_source().map(|(t, _)| t)
    }

    /// As [`Tcti::from_env`], with where it came from.
    pub fn from_env_with_source() -> Result<(Tcti, TctiSource)> {
        choose(|name| std::env::var(name).ok())
    }

    /// Whether this TCTI points at a software TPM (swtpm/mssim protocols).
    pub fn is_network_simulator(&self) -> bool {
        matches!(self, Tcti::Swtpm { .. } | Tcti::Mssim { .. })
    }

    /// Tries to reach the TPM without tpm2-tss, to say why tpm2-tss could
    /// not: connects to a simulator's command port, opens a device. `Ok`
    /// when that works (or cannot be checked, for tabrmd); otherwise the
    /// cause, e.g. "connection refused" or "/dev/tpmrm0: permission denied".
    pub(crate) fn probe(&self) -> std::result::Result<(), String> {
        use std::net::{TcpStream, ToSocketAddrs};
        use std::time::Duration;
        match self {
            Tcti::Device { path } => std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .map(drop)
                .map_err(|e| format!("{path}: {}", crate::error::io_cause(&e))),
            Tcti::Swtpm { host, port } | Tcti::Mssim { host, port } => {
                let addrs = (host.as_str(), *port)
                    .to_socket_addrs()
                    .map_err(|e| format!("{host}: {}", crate::error::io_cause(&e)))?;
                let mut last = format!("{host}: no address");
                for addr in addrs {
                    match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                        Ok(_) => return Ok(()),
                        Err(e) => last = crate::error::io_cause(&e),
                    }
                }
                Err(last)
            }
            Tcti::Tabrmd { .. } => Ok(()),
        }
    }

    /// Converts into the tss-esapi representation.
    pub fn to_name_conf(&self) -> Result<TctiNameConf> {
        let bad = |e: tss_esapi::Error| Error::InvalidInput(format!("TCTI '{self}': {e}"));
        Ok(match self {
            Tcti::Device { path } => {
                TctiNameConf::Device(DeviceConfig::from_str(path).map_err(bad)?)
            }
            Tcti::Swtpm { host, port } => TctiNameConf::Swtpm(
                NetworkTPMConfig::from_str(&format!("host={host},port={port}")).map_err(bad)?,
            ),
            Tcti::Mssim { host, port } => TctiNameConf::Mssim(
                NetworkTPMConfig::from_str(&format!("host={host},port={port}")).map_err(bad)?,
            ),
            Tcti::Tabrmd { config } => {
                TctiNameConf::Tabrmd(TabrmdConfig::from_str(config).map_err(bad)?)
            }
        })
    }
}

impl fmt::Display for Tcti {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tcti::Device { path } => write!(f, "device:{path}"),
            Tcti::Swtpm { host, port } => write!(f, "swtpm:host={host},port={port}"),
            Tcti::Mssim { host, port } => write!(f, "mssim:host={host},port={port}"),
            Tcti::Tabrmd { config } if config.is_empty() => write!(f, "tabrmd"),
            Tcti::Tabrmd { config } => write!(f, "tabrmd:{config}"),
        }
    }
}

/// Parses `host=H,port=P` (either may be missing; tpm2-tss defaults apply).
fn parse_network(kind: &str, conf: &str) -> Result<(String, u16)> {
    let mut host = "localhost".to_string();
    let mut port: u16 = 2321;
    for part in conf.split(',').filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').ok_or_else(|| {
            Error::InvalidInput(format!(
                "{kind} TCTI option '{part}' is not key=value (expected {kind}:host=H,port=P)"
            ))
        })?;
        match k.trim() {
            "host" => {
                let v = v.trim();
                if v.is_empty() || v.contains(|c: char| c.is_whitespace() || c.is_control()) {
                    return Err(Error::InvalidInput(format!("{kind} TCTI: bad host '{v}'")));
                }
                host = v.to_string();
            }
            "port" => {
                port = v
                    .trim()
                    .parse::<u16>()
                    .ok()
                    .filter(|p| *p != 0)
                    .ok_or_else(|| {
                        Error::InvalidInput(format!("{kind} TCTI: bad port '{v}' (1-65535)"))
                    })?;
            }
            other => {
                return Err(Error::InvalidInput(format!(
                    "{kind} TCTI: unknown option '{other}' (expected host= and port=)"
                )))
            }
        }
    }
    Ok((host, port))
}

impl FromStr for Tcti {
    type Err = Error;

    fn from_str(s: &str) -> Result<Tcti> {
        let s = s.trim();
        let (name, conf) = match s.split_once(':') {
            Some((n, c)) => (n, c),
            None => (s, ""),
        };
        // tpm2-tss also accepts the library file names (libtss2-tcti-device.so.0).
        let name = name
            .trim_start_matches("libtss2-tcti-")
            .trim_end_matches(".so.0")
            .trim_end_matches(".so");
        match name {
            "device" => {
                let path = conf.strip_prefix("path=").unwrap_or(conf);
                let path = if path.is_empty() { "/dev/tpmrm0" } else { path };
                if !path.starts_with('/') {
                    return Err(Error::InvalidInput(format!(
                        "device TCTI needs an absolute device path, got '{path}'"
                    )));
                }
                Ok(Tcti::Device {
                    path: path.to_string(),
                })
            }
            "swtpm" => {
                let (host, port) = parse_network("swtpm", conf)?;
                Ok(Tcti::Swtpm { host, port })
            }
            "mssim" => {
                let (host, port) = parse_network("mssim", conf)?;
                Ok(Tcti::Mssim { host, port })
            }
            "tabrmd" => Ok(Tcti::Tabrmd {
                config: conf.to_string(),
            }),
            "" => Err(Error::InvalidInput("empty TCTI string".into())),
            other => Err(Error::InvalidInput(format!(
                "unknown TCTI '{other}' (expected device:PATH, swtpm:host=H,port=P, \
                 mssim:host=H,port=P or tabrmd)"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_tpm2_tools_syntax() {
        assert_eq!(
            "device:/dev/tpm0".parse::<Tcti>().unwrap(),
            Tcti::Device {
                path: "/dev/tpm0".into()
            }
        );
        assert_eq!(
            "device".parse::<Tcti>().unwrap(),
            Tcti::Device {
                path: "/dev/tpmrm0".into()
            }
        );
        assert_eq!(
            "swtpm:host=127.0.0.1,port=2400".parse::<Tcti>().unwrap(),
            Tcti::Swtpm {
                host: "127.0.0.1".into(),
                port: 2400
            }
        );
        assert_eq!(
            "mssim:port=5".parse::<Tcti>().unwrap(),
            Tcti::Mssim {
                host: "localhost".into(),
                port: 5
            }
        );
        assert_eq!(
            "tabrmd".parse::<Tcti>().unwrap(),
            Tcti::Tabrmd {
                config: String::new()
            }
        );
        for s in [
            "",
            "foo",
            "swtpm:port=0",
            "swtpm:port=70000",
            "swtpm:hots=x",
            "device:rel",
            // Taken by the parser before, refused by tpm2-tss only when the
            // TPM was opened (exit 1 or 4, not a usage error).
            "swtpm:host=a=b,port=2",
            "swtpm:host=1.2.3.4:5,port=2",
            "tabrmd:bus_name=x",
            "swtpm:host=a\nb,port=2",
        ] {
            assert!(
                s.parse::<Tcti>().and_then(|t| t.to_name_conf()).is_err(),
                "{s}"
            );
        }
    }

    #[test]
    fn the_environment_is_read_in_order_and_a_bad_value_names_its_variable() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let all = env(&[
            ("TSS2_TCTI", "swtpm:port=3"),
            ("TPM2TOOLS_TCTI", "swtpm:port=2"),
            ("TPMCRYPT_TCTI", "swtpm:port=1"),
        ]);
        let port = |t: &Tcti| match t {
            Tcti::Swtpm { port, .. } => *port,
            other => panic!("{other}"),
        };
        let (t, s) = choose(all).unwrap();
        assert_eq!((port(&t), s), (1, TctiSource::Env("TPMCRYPT_TCTI")));
        let (t, s) = choose(env(&[
            ("TPMCRYPT_TCTI", "  "),
            ("TPM2TOOLS_TCTI", "swtpm:port=2"),
            ("TSS2_TCTI", "swtpm:port=3"),
        ]))
        .unwrap();
        assert_eq!((port(&t), s), (2, TctiSource::Env("TPM2TOOLS_TCTI")));
        let (t, s) = choose(env(&[("TSS2_TCTI", "swtpm:port=3")])).unwrap();
        assert_eq!((port(&t), s), (3, TctiSource::Env("TSS2_TCTI")));
        let (t, s) = choose(env(&[("TPM2TOOLS_TCTI", "")])).unwrap();
        assert_eq!(
            (t.to_string(), s),
            (DEFAULT_TCTI.into(), TctiSource::Default)
        );
        let e = choose(env(&[("TPM2TOOLS_TCTI", "cmd:x"), ("TSS2_TCTI", "device")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("TPM2TOOLS_TCTI: unknown TCTI 'cmd'"), "{e}");
    }

    #[test]
    fn round_trips_and_converts() {
        for s in [
            "device:/dev/tpmrm0",
            "swtpm:host=127.0.0.1,port=2321",
            "mssim:host=localhost,port=2321",
        ] {
            let t: Tcti = s.parse().unwrap();
            assert_eq!(t.to_string(), s);
            t.to_name_conf().unwrap();
        }
    }
}
