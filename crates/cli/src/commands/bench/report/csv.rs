//! The CSV: one table in long format, one line per measured or derived
//! value, written with the `csv` crate from one serde row type. One function
//! per section (TPM, bulk and model, split, matrix, per file, other tools).

use serde::{Serialize, Serializer};

use super::super::bulk::Series;
use super::Results;

/// A number written as Rust's `Display` writes it (`12.5`, `3`, `inf`),
/// the CSV's format from its first version (the `csv` crate alone would
/// write `3.0`).
#[derive(Clone, Copy)]
struct Num(f64);

impl Serialize for Num {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

/// One line; the field names are the header. Empty strings and `None` are
/// empty cells.
#[derive(Serialize, Default)]
struct Row<'a> {
    section: &'a str,
    item: &'a str,
    aes: &'a str,
    backend: &'a str,
    mode: &'a str,
    key_bits: Option<u32>,
    direction: &'a str,
    size_bytes: Option<u64>,
    files_per_session: Option<u64>,
    median_ms: Option<Num>,
    min_ms: Option<Num>,
    max_ms: Option<Num>,
    runs: Option<u64>,
    noisy: Option<bool>,
    mb_per_s: Option<Num>,
    cycles_per_byte: Option<Num>,
    tpm_share_pct: Option<Num>,
    overhead_us: Option<Num>,
    bandwidth_mb_s: Option<Num>,
    projection: bool,
}

/// The CSV's error: writing into memory fails only if serde does.
#[derive(Debug, thiserror::Error)]
#[error("writing the CSV: {0}")]
pub struct CsvError(#[from] ::csv::Error);

/// Whether `text` begins with the header line this CSV is written with:
/// a file an earlier bench wrote, which `--csv` may replace.
pub fn is_bench_csv(text: &[u8]) -> bool {
    let mut w = ::csv::Writer::from_writer(Vec::new());
    let Ok(header) = w
        .serialize(Row::default())
        .map_err(CsvError)
        .and_then(|()| w.into_inner().map_err(|e| CsvError(e.into_error().into())))
    else {
        return false;
    };
    let first = |t: &[u8]| t.split(|&b| b == b'\n').next().map(<[u8]>::to_vec);
    first(&header).is_some_and(|h| first(text) == Some(h))
}

impl Results {
    /// One CSV table, long format: one line per measured or derived value.
    pub fn csv(&self) -> Result<String, CsvError> {
        let mut rows = Vec::new();
        self.tpm_rows(&mut rows);
        self.bulk_rows(&mut rows);
        self.split_rows(&mut rows);
        self.matrix_rows(&mut rows);
        self.per_file_rows(&mut rows);
        self.peer_rows(&mut rows);
        let mut w = ::csv::Writer::from_writer(Vec::new());
        for r in &rows {
            w.serialize(r)?;
        }
        let bytes = w
            .into_inner()
            .map_err(|e| CsvError(::csv::Error::from(e.into_error())))?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn tpm_rows<'a>(&'a self, rows: &mut Vec<Row<'a>>) {
        for op in &self.tpm.ops {
            rows.push(Row {
                section: "tpm",
                item: &op.name,
                median_ms: Some(Num(op.time.median_ms)),
                min_ms: Some(Num(op.time.min_ms)),
                max_ms: Some(Num(op.time.max_ms)),
                runs: Some(op.time.samples_ms.len() as u64),
                noisy: Some(op.time.noisy),
                ..Row::default()
            });
        }
    }

    fn bulk_rows<'a>(&'a self, rows: &mut Vec<Row<'a>>) {
        for s in &self.bulk {
            for p in &s.points {
                rows.push(Row {
                    size_bytes: Some(p.size),
                    median_ms: Some(Num(p.time.median_ms)),
                    min_ms: Some(Num(p.time.min_ms)),
                    max_ms: Some(Num(p.time.max_ms)),
                    runs: Some(u64::from(p.runs)),
                    noisy: Some(p.time.noisy),
                    mb_per_s: Some(Num(p.mb_per_s)),
                    cycles_per_byte: p.cycles_per_byte.map(Num),
                    ..series_row("bulk", s)
                });
            }
            if let Some(m) = &s.model {
                rows.push(Row {
                    cycles_per_byte: m.cycles_per_byte.map(Num),
                    overhead_us: Some(Num(m.overhead_us)),
                    bandwidth_mb_s: Some(Num(m.bandwidth_mb_s)),
                    ..series_row("model", s)
                });
            }
        }
    }

    fn split_rows<'a>(&'a self, rows: &mut Vec<Row<'a>>) {
        for r in &self.split {
            rows.push(Row {
                section: "split",
                item: &r.unbind_source,
                aes: &r.aes,
                backend: &r.backend,
                mode: &r.mode,
                key_bits: Some(256),
                direction: "decrypt",
                size_bytes: Some(r.size),
                files_per_session: Some(u64::from(r.files_per_session)),
                median_ms: Some(Num(r.total_ms)),
                tpm_share_pct: Some(Num(r.tpm_share_pct)),
                projection: r.projection,
                ..Row::default()
            });
        }
    }

    fn matrix_rows<'a>(&'a self, rows: &mut Vec<Row<'a>>) {
        for r in &self.matrix.rows {
            let sides = [
                ("hardware", Some(r.hardware_mb_s)),
                ("software", r.software_mb_s),
            ];
            for (aes, mb_s) in sides {
                let Some(mb_s) = mb_s else { continue };
                rows.push(Row {
                    section: "matrix",
                    item: aes,
                    aes,
                    backend: "openssl",
                    mode: &r.mode,
                    key_bits: Some(r.key_bits),
                    direction: "encrypt",
                    size_bytes: Some(r.size),
                    noisy: Some(r.noisy),
                    mb_per_s: Some(Num(mb_s)),
                    ..Row::default()
                });
            }
        }
    }

    /// The per-file series: one line per part of each point (`median_ms`
    /// is ms per file; `files_per_session` the tree's files).
    fn per_file_rows<'a>(&'a self, rows: &mut Vec<Row<'a>>) {
        for p in &self.per_file.points {
            let parts = [
                ("total", p.total_ms),
                ("unwrap", p.unwrap_ms),
                ("aes_cpu", p.aes_cpu_ms),
                ("io", p.io_ms),
                ("commit", p.commit_ms),
                ("other", p.other_ms),
            ];
            for (item, v) in parts {
                rows.push(Row {
                    section: "perfile",
                    item,
                    mode: &p.sync,
                    key_bits: Some(256),
                    direction: &p.direction,
                    size_bytes: Some(p.size),
                    files_per_session: Some(p.files),
                    median_ms: Some(Num(v)),
                    runs: Some(u64::from(p.runs)),
                    noisy: Some(false),
                    mb_per_s: (item == "total").then(|| Num(p.files_per_s * p.size as f64 / 1e6)),
                    ..Row::default()
                });
            }
        }
    }

    fn peer_rows<'a>(&'a self, rows: &mut Vec<Row<'a>>) {
        for p in &self.peers {
            for pt in &p.points {
                rows.push(Row {
                    section: "peer",
                    item: &p.tool,
                    direction: "encrypt",
                    size_bytes: Some(pt.size),
                    median_ms: Some(Num(pt.time.median_ms)),
                    min_ms: Some(Num(pt.time.min_ms)),
                    max_ms: Some(Num(pt.time.max_ms)),
                    runs: Some(pt.time.samples_ms.len() as u64),
                    noisy: Some(pt.time.noisy),
                    mb_per_s: Some(Num(pt.mb_per_s)),
                    ..Row::default()
                });
            }
        }
    }
}

/// The cells that name a bulk series.
fn series_row<'a>(section: &'a str, s: &'a Series) -> Row<'a> {
    Row {
        section,
        item: &s.id,
        aes: &s.aes,
        backend: &s.backend,
        mode: &s.mode,
        key_bits: Some(s.key_bits),
        direction: &s.direction,
        ..Row::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_written_as_display_writes_them() {
        let mut w = ::csv::Writer::from_writer(Vec::new());
        w.serialize(Row {
            section: "x",
            key_bits: Some(256),
            median_ms: Some(Num(3.0)),
            min_ms: Some(Num(0.125)),
            noisy: Some(true),
            ..Row::default()
        })
        .expect("serialize");
        let text = String::from_utf8(w.into_inner().expect("flush")).expect("utf-8");
        let mut lines = text.lines();
        assert_eq!(lines.next().map(|h| h.split(',').count()), Some(20));
        assert_eq!(lines.next(), Some("x,,,,,256,,,,3,0.125,,,true,,,,,,false"));
    }
}
