//! Plots for `oxcomm bench --plot FILE` and `oxcomm bench --compare A.json B.json … --plot
//! FILE`: bus bandwidth (GB/s) and time per op (µs, log scale) against message size (log₂
//! scale), one line per op and mode (and per file when comparing).
//!
//! This module owns the picture (layout, axes, colours, legend), the file formats it writes
//! (SVG, and PNG: plotters' bitmap backend into memory, encoded with the `png` crate) and reading the JSON Lines rows of earlier
//! `--json` runs. It does not run collectives or compute bandwidths: it draws the rows
//! [`crate::bench`] produced.
//!
//! # Reading a plot
//!
//! Left: `busbw`, nccl-tests' bus bandwidth, on a linear axis. Right: the mean time per op
//! (max over ranks) on a log axis. A colour is an op (and a file, when comparing); a solid
//! line is out-of-place, a dashed line in-place. Lines of size 0 (a buffer too small for one
//! element per rank) are left out.
//!
//! # Fonts
//!
//! Text is laid out (and, in PNGs, drawn) with DejaVu Sans, which the `dejavu` crate ships,
//! so no system font or library is needed. SVGs name the family `sans-serif` and leave the
//! glyphs to the viewer.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Once;

use anyhow::{anyhow, bail, Context};
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::FontStyle;
use serde::Deserialize;

/// Width and height of a plot, in pixels.
const SIZE: (u32, u32) = (1700, 820);

/// Width of the legend column, in pixels.
const LEGEND_WIDTH: u32 = 400;

/// The colours of the lines (Tableau 10), one per op (per file and op when comparing).
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// One measured point: one row of the bench's JSON output (the fields a plot needs; other
/// fields of a row are ignored when reading).
#[derive(Debug, Clone, Deserialize)]
pub struct Point {
    /// The op's name.
    pub op: String,
    /// In-place (dashed) or out-of-place (solid).
    pub in_place: bool,
    /// The line's size in bytes.
    pub size_bytes: u64,
    /// Mean time per op, µs.
    pub time_us: f64,
    /// Bus bandwidth, GB/s.
    pub busbw_gbps: f64,
    /// The transport the run used.
    pub transport: String,
    /// Ranks of the run.
    pub world_size: usize,
    /// Element type of the run.
    pub dtype: String,
}

/// One line of the plot.
#[derive(Debug, Clone)]
pub struct Series {
    /// The legend's text.
    pub label: String,
    /// Index into the palette.
    pub colour: usize,
    /// In-place: drawn dashed.
    pub dashed: bool,
    /// (size in bytes, busbw in GB/s, time in µs), by size.
    pub points: Vec<(u64, f64, f64)>,
}

/// The format of a plot file, from its extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `.svg`.
    Svg,
    /// `.png`.
    Png,
}

impl Format {
    /// The format `path`'s extension names, or an error naming the ones we write.
    pub fn of(path: &Path) -> anyhow::Result<Format> {
        match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
            Some("svg") => Ok(Format::Svg),
            Some("png") => Ok(Format::Png),
            _ => bail!("--plot {}: the file name must end in .svg or .png", path.display()),
        }
    }
}

/// Groups `points` into lines, one per (op, mode), in the order they first appear. `file`
/// (when comparing) prefixes every label and takes colours from `colour_base` on.
pub fn series(points: &[Point], file: Option<(&str, usize)>) -> Vec<Series> {
    let (prefix, base) = match file {
        Some((name, base)) => (format!("{name}: "), base),
        None => (String::new(), 0),
    };
    let mut ops: Vec<&str> = Vec::new();
    let mut out: Vec<Series> = Vec::new();
    for p in points.iter().filter(|p| p.size_bytes > 0) {
        if !ops.contains(&p.op.as_str()) {
            ops.push(&p.op);
        }
        let colour = base + ops.iter().position(|o| *o == p.op).unwrap_or(0);
        let label = format!("{prefix}{} ({})", p.op, if p.in_place { "in-place" } else { "out-of-place" });
        let i = match out.iter().position(|s| s.label == label) {
            Some(i) => i,
            None => {
                out.push(Series { label, colour, dashed: p.in_place, points: Vec::new() });
                out.len() - 1
            }
        };
        out[i].points.push((p.size_bytes, p.busbw_gbps, p.time_us));
    }
    for s in &mut out {
        s.points.sort_by_key(|p| p.0);
    }
    out
}

/// The plot's title for the points of one run (or several, when comparing).
pub fn title_of(points: &[Point]) -> String {
    let set = |f: &dyn Fn(&Point) -> String| -> String {
        let values: BTreeSet<String> = points.iter().map(f).collect();
        values.into_iter().collect::<Vec<_>>().join("/")
    };
    format!(
        "oxcomm bench · transport {} · {} ranks · {}",
        set(&|p| p.transport.clone()),
        set(&|p| p.world_size.to_string()),
        set(&|p| p.dtype.clone())
    )
}

/// `--compare`: reads the rows of every JSON Lines file and draws them all to `out`. With
/// several files each line is labelled with its file's name (without `.json`; the path as
/// given when two names are the same).
pub fn compare(files: &[PathBuf], out: &Path) -> anyhow::Result<()> {
    Format::of(out)?;
    let stem = |p: &PathBuf| p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let stems: Vec<String> = files.iter().map(stem).collect();
    let unique = stems.iter().collect::<BTreeSet<_>>().len() == stems.len();
    let mut all_series = Vec::new();
    let mut all_points = Vec::new();
    let mut colour = 0;
    for (path, name) in files.iter().zip(&stems) {
        let points = read_rows(path)?;
        if points.is_empty() {
            bail!("{}: no rows", path.display());
        }
        let name = if unique { name.clone() } else { path.display().to_string() };
        let s = if files.len() == 1 { series(&points, None) } else { series(&points, Some((&name, colour))) };
        colour = s.iter().map(|s| s.colour + 1).max().unwrap_or(colour);
        all_series.extend(s);
        all_points.extend(points);
    }
    draw(&all_series, &title_of(&all_points), out)
}

/// The rows of a `--json` file (JSON Lines; blank lines are skipped).
pub fn read_rows(path: &Path) -> anyhow::Result<Vec<Point>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l)
                .with_context(|| format!("{}:{}: not a row of oxcomm bench --json", path.display(), i + 1))
        })
        .collect()
}

/// Draws `series` under `title` to `out` (SVG or PNG, by its extension).
pub fn draw(series: &[Series], title: &str, out: &Path) -> anyhow::Result<()> {
    if series.iter().all(|s| s.points.is_empty()) {
        bail!("nothing to plot: every line has size 0");
    }
    register_font()?;
    let failed = |e: String| anyhow!("cannot draw {}: {e}", out.display());
    match Format::of(out)? {
        Format::Svg => {
            let root = SVGBackend::new(out, SIZE).into_drawing_area();
            render(&root, series, title).map_err(|e| failed(e.to_string()))?;
            root.present().map_err(|e| failed(e.to_string()))?;
        }
        Format::Png => {
            let mut rgb = vec![0u8; SIZE.0 as usize * SIZE.1 as usize * 3];
            {
                let root = BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area();
                render(&root, series, title).map_err(|e| failed(e.to_string()))?;
                root.present().map_err(|e| failed(e.to_string()))?;
            }
            write_png(out, &rgb).with_context(|| format!("cannot write {}", out.display()))?;
        }
    }
    Ok(())
}

/// Encodes an RGB image of [`SIZE`] as a PNG, compressed as well as the encoder can (a plot is
/// mostly flat colour, so this is about 40% smaller than the default).
fn write_png(out: &Path, rgb: &[u8]) -> anyhow::Result<()> {
    let file = std::io::BufWriter::new(std::fs::File::create(out)?);
    let mut encoder = png::Encoder::new(file, SIZE.0, SIZE.1);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Best);
    encoder.set_adaptive_filter(png::AdaptiveFilterType::Adaptive);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(())
}

/// Registers DejaVu Sans as plotters' `sans-serif` (once per process).
fn register_font() -> anyhow::Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .map_err(|_| anyhow!("the bundled DejaVu Sans font does not load"));
    });
    result
}

type DrawResult<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// Title on top, the two charts side by side, the legend on the right.
fn render<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, series: &[Series], title: &str) -> DrawResult<DB> {
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 26))?;
    let (charts, legend) = root.split_horizontally(SIZE.0 - LEGEND_WIDTH);
    let (left, right) = charts.split_horizontally((SIZE.0 - LEGEND_WIDTH) / 2);

    let points = || series.iter().flat_map(|s| s.points.iter());
    let log2 = |b: u64| (b as f64).log2();
    let x_lo = points().map(|p| log2(p.0)).fold(f64::INFINITY, f64::min);
    let x_hi = points().map(|p| log2(p.0)).fold(f64::NEG_INFINITY, f64::max);
    let (x_lo, x_hi) = if x_hi - x_lo < 1.0 { (x_lo - 1.0, x_hi + 1.0) } else { (x_lo, x_hi) };
    let x_range = (x_lo - 0.3)..(x_hi + 0.3);
    let x_labels = ((x_hi - x_lo) as usize + 1).min(14);
    let x_fmt = |x: &f64| {
        if (x - x.round()).abs() < 1e-6 && *x >= 0.0 {
            human_size(2f64.powf(x.round()) as u64)
        } else {
            String::new()
        }
    };

    // Bus bandwidth, linear.
    let bw_hi = points().map(|p| p.1).fold(0.0, f64::max).max(1e-3) * 1.08;
    let mut bw = ChartBuilder::on(&left)
        .caption("bus bandwidth (higher is better)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(x_range.clone(), 0.0..bw_hi)?;
    bw.configure_mesh()
        .x_desc("message size")
        .y_desc("busbw (GB/s)")
        .x_labels(x_labels)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&|y: &f64| format!("{y:.1}"))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .light_line_style(TRANSPARENT)
        .bold_line_style(RGBColor(200, 200, 200))
        .draw()?;
    for s in series {
        let style = PALETTE[s.colour % PALETTE.len()].stroke_width(2);
        let pts: Vec<(f64, f64)> = s.points.iter().map(|p| (log2(p.0), p.1)).collect();
        draw_line(&mut bw, pts, style, s.dashed)?;
    }

    // Time per op, log.
    let t_lo = points().map(|p| p.2).filter(|t| *t > 0.0).fold(f64::INFINITY, f64::min);
    let t_hi = points().map(|p| p.2).fold(0.0, f64::max);
    let (t_lo, t_hi) = if t_lo.is_finite() && t_hi > 0.0 { (t_lo * 0.8, t_hi * 1.25) } else { (0.1, 10.0) };
    let mut lat = ChartBuilder::on(&right)
        .caption("time per op (lower is better)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x_range, (t_lo..t_hi).log_scale())?;
    lat.configure_mesh()
        .x_desc("message size")
        .y_desc("time (µs, log scale)")
        .x_labels(x_labels)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&|y: &f64| fmt_time(*y))
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 16))
        .light_line_style(TRANSPARENT)
        .bold_line_style(RGBColor(200, 200, 200))
        .draw()?;
    for s in series {
        let style = PALETTE[s.colour % PALETTE.len()].stroke_width(2);
        let pts: Vec<(f64, f64)> = s.points.iter().filter(|p| p.2 > 0.0).map(|p| (log2(p.0), p.2)).collect();
        draw_line(&mut lat, pts, style, s.dashed)?;
    }

    draw_legend(&legend, series)
}

/// A line with a dot at every point; dashed for in-place.
fn draw_line<DB: DrawingBackend, CT: plotters::coord::CoordTranslate<From = (f64, f64)>>(
    chart: &mut ChartContext<'_, DB, CT>,
    pts: Vec<(f64, f64)>,
    style: ShapeStyle,
    dashed: bool,
) -> DrawResult<DB> {
    if dashed {
        chart.draw_series(DashedLineSeries::new(pts.clone(), 7, 5, style))?;
    } else {
        chart.draw_series(LineSeries::new(pts.clone(), style))?;
    }
    chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, style.color.filled())))?;
    Ok(())
}

/// The legend column: a sample of each line and its label.
fn draw_legend<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, series: &[Series]) -> DrawResult<DB> {
    let (w, _) = area.dim_in_pixel();
    let text = ("sans-serif", 14).into_font().color(&BLACK);
    area.draw(&Text::new("solid: out-of-place, dashed: in-place", (8, 50), text.clone()))?;
    let row = if series.len() > 30 { 20 } else { 24 };
    for (i, s) in series.iter().enumerate() {
        let y = 80 + i as i32 * row;
        let style = PALETTE[s.colour % PALETTE.len()].stroke_width(3);
        let sample = vec![(8, y), (44, y)];
        if s.dashed {
            area.draw(&DashedPathElement::new(sample, 7, 5, style))?;
        } else {
            area.draw(&PathElement::new(sample, style))?;
        }
        area.draw(&Circle::new((26, y), 3, style.color.filled()))?;
        let mut label = s.label.clone();
        let max_chars = (w as usize).saturating_sub(60) / 7;
        if label.chars().count() > max_chars {
            label = label.chars().take(max_chars.saturating_sub(1)).collect::<String>() + "…";
        }
        area.draw(&Text::new(label, (52, y - 8), text.clone()))?;
    }
    Ok(())
}

/// A byte count for an axis: 8, 512, 1K, 64K, 1M, 1G.
fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["", "K", "M", "G", "T"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024 && v % 1024 == 0 && u + 1 < UNITS.len() {
        v /= 1024;
        u += 1;
    }
    format!("{v}{}", UNITS[u])
}

/// A time in µs for a log axis: 0.5, 3, 20, 1000, 1e+04.
fn fmt_time(us: f64) -> String {
    if us >= 1e5 {
        format!("{us:.0e}")
    } else if us >= 1.0 {
        format!("{us:.0}")
    } else {
        format!("{us:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(op: &str, in_place: bool, size: u64, t: f64) -> Point {
        Point {
            op: op.into(),
            in_place,
            size_bytes: size,
            time_us: t,
            busbw_gbps: size as f64 / t / 1e3,
            transport: "threads".into(),
            world_size: 2,
            dtype: "f32".into(),
        }
    }

    #[test]
    fn series_group_by_op_and_mode_and_skip_size_zero() {
        let pts = [
            point("all_reduce", false, 0, 1.0),
            point("all_reduce", false, 8, 1.0),
            point("all_reduce", true, 8, 1.0),
            point("all_reduce", false, 16, 2.0),
            point("broadcast", false, 8, 1.0),
        ];
        let s = series(&pts, None);
        let labels: Vec<&str> = s.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, ["all_reduce (out-of-place)", "all_reduce (in-place)", "broadcast (out-of-place)"]);
        assert_eq!(s[0].points.len(), 2);
        assert_eq!((s[0].colour, s[1].colour, s[2].colour), (0, 0, 1));
        assert!(s[1].dashed && !s[0].dashed);
        let s = series(&pts, Some(("run1", 3)));
        assert_eq!(s[2].label, "run1: broadcast (out-of-place)");
        assert_eq!(s[2].colour, 4);
    }

    #[test]
    fn formats_come_from_the_extension() {
        assert_eq!(Format::of(Path::new("a/b.svg")).unwrap(), Format::Svg);
        assert_eq!(Format::of(Path::new("b.PNG")).unwrap(), Format::Png);
        assert!(Format::of(Path::new("b.pdf")).is_err());
        assert!(Format::of(Path::new("b")).is_err());
    }

    #[test]
    fn axis_labels_read_as_sizes() {
        assert_eq!(human_size(8), "8");
        assert_eq!(human_size(1024), "1K");
        assert_eq!(human_size(64 << 20), "64M");
        assert_eq!(human_size(1536), "1536");
        assert_eq!(fmt_time(0.5), "0.50");
        assert_eq!(fmt_time(250.0), "250");
    }

    #[test]
    fn titles_list_every_transport() {
        let mut b = point("x", false, 8, 1.0);
        b.transport = "shm".into();
        assert_eq!(title_of(&[point("x", false, 8, 1.0), b]), "oxcomm bench · transport shm/threads · 2 ranks · f32");
    }
}
