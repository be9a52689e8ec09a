//! The figure: where the time of decrypting one file goes (TPM unbind vs
//! bulk AES, hardware vs software AES) by file size, and throughput by file
//! size on log-log axes. SVG or PNG, chosen by the file extension.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Context as _};
use plotters::coord::{CoordTranslate, Shift};
use plotters::prelude::*;

use super::bulk::{HARDWARE, SOFTWARE};
use super::report::{Results, UnbindSource};
use super::stats::human_size;

/// One bar pair: TPM share of the total with hardware and software AES.
pub struct Bar {
    /// File size.
    pub size: u64,
    /// Unbind / (unbind + bulk) with hardware AES, percent.
    pub hw_tpm_pct: f64,
    /// The same with software AES (None when not measured).
    pub sw_tpm_pct: Option<f64>,
}

/// One throughput curve.
pub struct Curve {
    /// Legend text.
    pub label: String,
    /// (bytes, MB/s).
    pub points: Vec<(f64, f64)>,
    /// Software AES (drawn dashed).
    pub software: bool,
}

/// What to draw.
pub struct PlotData {
    /// Figure title.
    pub title: String,
    /// Where the unbind time comes from (e.g. "measured: swtpm RSA-2048
    /// unbind 12.3 ms" or "projection: TPM 1.2 of the study, 1290 ms").
    pub unbind_label: String,
    /// Bars by size.
    pub bars: Vec<Bar>,
    /// Curves.
    pub curves: Vec<Curve>,
}

const FONT: &str = "sans-serif";

/// TrueType fonts tried, in order, for text in the figure.
const FONT_PATHS: [&str; 6] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
];

/// Registers a system sans-serif font once (plotters needs one to lay out
/// text, also for SVG).
fn ensure_font() -> anyhow::Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let mut candidates: Vec<std::path::PathBuf> =
            FONT_PATHS.iter().map(std::path::PathBuf::from).collect();
        if let Ok(out) = std::process::Command::new("fc-match")
            .args(["-f", "%{file}", "sans-serif:style=Regular"])
            .output()
        {
            let p = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if p.ends_with(".ttf") || p.ends_with(".otf") {
                candidates.push(p.into());
            }
        }
        for p in candidates {
            if let Ok(bytes) = std::fs::read(&p) {
                // plotters keeps fonts for the life of the process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err("no TrueType font found for the plot's text (install fonts-dejavu-core)".into())
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

fn pe<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing the plot: {e}")
}

/// Renders the figure as the bytes of a file named `path` (`.svg` or
/// `.png`, by its extension); the caller writes them (atomically). A PNG
/// is drawn into a private temporary directory first (the plotting
/// library writes PNGs only to a path).
pub fn render(path: &Path, data: &PlotData) -> anyhow::Result<Vec<u8>> {
    ensure_font()?;
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let size = (1400, 1100);
    match ext.as_deref() {
        Some("svg") => {
            let mut text = String::new();
            {
                let root = SVGBackend::with_string(&mut text, size).into_drawing_area();
                draw(&root, data)?;
                root.present().map_err(pe)?;
            }
            Ok(text.into_bytes())
        }
        Some("png") => {
            let tmp = tempfile::Builder::new()
                .prefix("tpmcrypt-plot-")
                .tempdir()
                .context("a temporary directory for the plot")?;
            let file = tmp.path().join("plot.png");
            {
                let root = BitMapBackend::new(&file, size).into_drawing_area();
                draw(&root, data)?;
                root.present().map_err(pe)?;
            }
            std::fs::read(&file).context("reading the drawn plot")
        }
        _ => bail!("{}: the plot file must end in .svg or .png", path.display()),
    }
}

/// Whether `text` is an SVG this figure was drawn as: the plotting
/// library's `<svg` element and the figure's title (see [`data`]), in the
/// first KiB.
pub fn is_bench_svg(text: &[u8]) -> bool {
    let head = &text[..text.len().min(1024)];
    head.starts_with(b"<svg ")
        && memchr::memmem::find(head, format!("\n{TITLE_START}").as_bytes()).is_some()
}

/// How the figure's title begins.
const TITLE_START: &str = "tpmcrypt bench \u{2014} ";

const UNBIND: RGBColor = RGBColor(214, 96, 77);
const HW: RGBColor = RGBColor(33, 102, 172);
const SW: RGBColor = RGBColor(77, 172, 38);
const PALETTE: [RGBColor; 8] = [
    RGBColor(33, 102, 172),
    RGBColor(146, 197, 222),
    RGBColor(118, 42, 131),
    RGBColor(230, 97, 1),
    RGBColor(0, 0, 0),
    RGBColor(77, 172, 38),
    RGBColor(140, 81, 10),
    RGBColor(197, 27, 125),
];

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, d: &PlotData) -> anyhow::Result<()> {
    root.fill(&WHITE).map_err(pe)?;
    let root = root.titled(&d.title, (FONT, 28).into_font()).map_err(pe)?;
    let (top, bottom) = root.split_vertically(520);
    draw_bars(&top, d)?;
    draw_curves(&bottom, d)?;
    Ok(())
}

fn draw_bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    d: &PlotData,
) -> anyhow::Result<()> {
    let n = d.bars.len().max(1);
    let labels: Vec<String> = d.bars.iter().map(|b| human_size(b.size)).collect();
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!(
                "Decrypting one file: TPM unbind vs bulk AES-256-CBC-HS512 ({})",
                d.unbind_label
            ),
            (FONT, 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..100f64)
        .map_err(pe)?;
    let fmt = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 {
            labels.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&fmt)
        .y_label_formatter(&|y: &f64| format!("{y:.0}%"))
        .y_desc("share of the time per file (%)")
        .x_desc("file size   (left bar: AES-NI, right bar: software AES)")
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()
        .map_err(pe)?;
    draw_bar_series(&mut chart, d, n)?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font((FONT, 16))
        .draw()
        .map_err(pe)?;
    Ok(())
}

/// The bars (TPM share, bulk with and without AES-NI) and the 50 % line.
fn draw_bar_series<DB: DrawingBackend, CT: CoordTranslate<From = (f64, f64)>>(
    chart: &mut ChartContext<'_, DB, CT>,
    d: &PlotData,
    n: usize,
) -> anyhow::Result<()> {
    let bar = |i: usize, left: bool, lo: f64, hi: f64| {
        let x = i as f64;
        let (x0, x1) = if left {
            (x - 0.4, x - 0.02)
        } else {
            (x + 0.02, x + 0.4)
        };
        [(x0, lo), (x1, hi)]
    };
    chart
        .draw_series(d.bars.iter().enumerate().flat_map(|(i, b)| {
            let mut v = vec![Rectangle::new(
                bar(i, true, 0.0, b.hw_tpm_pct),
                UNBIND.filled(),
            )];
            if let Some(s) = b.sw_tpm_pct {
                v.push(Rectangle::new(bar(i, false, 0.0, s), UNBIND.filled()));
            }
            v
        }))
        .map_err(pe)?
        .label("TPM unbind")
        .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], UNBIND.filled()));
    chart
        .draw_series(
            d.bars
                .iter()
                .enumerate()
                .map(|(i, b)| Rectangle::new(bar(i, true, b.hw_tpm_pct, 100.0), HW.filled())),
        )
        .map_err(pe)?
        .label("bulk AES, AES-NI")
        .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], HW.filled()));
    chart
        .draw_series(d.bars.iter().enumerate().filter_map(|(i, b)| {
            b.sw_tpm_pct
                .map(|s| Rectangle::new(bar(i, false, s, 100.0), SW.filled()))
        }))
        .map_err(pe)?
        .label("bulk AES, software")
        .legend(|(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], SW.filled()));
    chart
        .draw_series(LineSeries::new(
            vec![(-0.5, 50.0), (n as f64 - 0.5, 50.0)],
            BLACK.stroke_width(1),
        ))
        .map_err(pe)?;
    Ok(())
}

/// Tick positions: powers of four bytes (16 KiB, 64 KiB, …) in range.
fn key_sizes(lo: f64, hi: f64) -> Vec<f64> {
    (0..40)
        .map(|e| 4f64.powi(e))
        .filter(|&v| v >= lo / 1.01 && v <= hi * 1.01)
        .collect()
}

/// The range of the curves' positive points: (x min, x max, y min, y max).
fn bounds(d: &PlotData) -> (f64, f64, f64, f64) {
    let all = d.curves.iter().flat_map(|c| c.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all {
        if x > 0.0 && y > 0.0 && x.is_finite() && y.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
    }
    if x0 > x1 {
        return (1024.0, 1048576.0, 1.0, 1000.0);
    }
    (x0, x1, y0, y1)
}

fn draw_curves<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    d: &PlotData,
) -> anyhow::Result<()> {
    let (x0, x1, y0, y1) = bounds(d);
    let mut chart = ChartBuilder::on(area)
        .caption(
            "Throughput by file size, decrypt, in memory, one thread (log-log)",
            (FONT, 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            (x0 / 1.3..x1 * 1.3)
                .log_scale()
                .with_key_points(key_sizes(x0, x1)),
            (y0 / 2.0..y1 * 3.0).log_scale(),
        )
        .map_err(pe)?;
    let xf = |x: &f64| human_size(x.round() as u64);
    let yf = |y: &f64| {
        if *y >= 10.0 {
            format!("{y:.0}")
        } else {
            format!("{y:.2}")
        }
    };
    chart
        .configure_mesh()
        .x_label_formatter(&xf)
        .y_label_formatter(&yf)
        .y_desc("MB/s")
        .x_desc("file size")
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()
        .map_err(pe)?;
    for (i, c) in d.curves.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let style = color.stroke_width(if c.software { 2 } else { 3 });
        let pts: Vec<(f64, f64)> = c
            .points
            .iter()
            .copied()
            .filter(|&(x, y)| x > 0.0 && y > 0.0)
            .collect();
        if c.software {
            chart
                .draw_series(DashedLineSeries::new(pts.clone(), 10, 6, style))
                .map_err(pe)?
                .label(&c.label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        } else {
            chart
                .draw_series(LineSeries::new(pts.clone(), style))
                .map_err(pe)?
                .label(&c.label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                });
        }
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(pe)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font((FONT, 15))
        .draw()
        .map_err(pe)?;
    Ok(())
}

/// The figure's data from a run's results: the TPM share of one file's
/// decryption (bars) and the bulk bandwidth curves.
pub fn data(r: &Results) -> PlotData {
    let src = r.unbind_sources.first();
    let unbind_label = src
        .map(|s| {
            format!(
                "{}{}: {:.1} ms",
                if s.projection {
                    "PROJECTION, "
                } else {
                    "measured, "
                },
                s.id,
                s.unbind_ms
            )
        })
        .unwrap_or_else(|| "no unbind".into());
    PlotData {
        title: format!(
            "{TITLE_START}{} — tpmcrypt {}",
            r.system.cpu_model, r.system.tpmcrypt_version
        ),
        unbind_label,
        bars: bars(r, src),
        curves: curves(r, src),
    }
}

/// The TPM share of one file's decryption (cbc-hs512, one file per
/// session) by size, with and without AES-NI.
fn bars(r: &Results, src: Option<&UnbindSource>) -> Vec<Bar> {
    let share = |aes: &str, size: u64| {
        let s = src?;
        r.split
            .iter()
            .find(|x| {
                x.unbind_source == s.id
                    && x.aes == aes
                    && x.mode == "cbc-hs512"
                    && x.size == size
                    && x.files_per_session == 1
            })
            .map(|x| x.tpm_share_pct)
    };
    r.config
        .sizes
        .iter()
        .filter_map(|&size| {
            Some(Bar {
                size,
                hw_tpm_pct: share(HARDWARE, size)?,
                sw_tpm_pct: share(SOFTWARE, size),
            })
        })
        .collect()
}

/// Bulk decryption bandwidth by size, and the same with one unbind added.
fn curves(r: &Results, src: Option<&UnbindSource>) -> Vec<Curve> {
    let mut curves = Vec::new();
    for id in [
        "hardware/openssl/cbc-raw/decrypt",
        "hardware/openssl/cbc-hs512/decrypt",
        "hardware/openssl/gcm/decrypt",
        "hardware/ring/gcm/decrypt",
        "software/openssl/cbc-raw/decrypt",
        "software/openssl/cbc-hs512/decrypt",
        "software/openssl/gcm/decrypt",
    ] {
        if let Some(s) = r.series(id) {
            curves.push(Curve {
                label: format!(
                    "{} {} ({})",
                    if s.aes == HARDWARE {
                        "AES-NI"
                    } else {
                        "software"
                    },
                    s.mode,
                    s.backend
                ),
                points: s
                    .points
                    .iter()
                    .map(|p| (p.size as f64, p.mb_per_s))
                    .collect(),
                software: s.aes == SOFTWARE,
            });
        }
    }
    if let (Some(src), Some(s)) = (src, r.series("hardware/openssl/cbc-hs512/decrypt")) {
        curves.push(Curve {
            label: format!("AES-NI cbc-hs512 + one unbind ({:.1} ms)", src.unbind_ms),
            points: s
                .points
                .iter()
                .map(|p| {
                    (
                        p.size as f64,
                        p.size as f64 / ((p.time.median_ms + src.unbind_ms) / 1e3) / 1e6,
                    )
                })
                .collect(),
            software: false,
        });
    }
    curves
}
