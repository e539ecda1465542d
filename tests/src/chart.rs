//! Charts of the throughput benchmark's report: requests per second, and
//! the database's CPU per request, against the database's round-trip
//! time, one line per scenario, as SVG.
//!
//! The SVG keeps its labels as `<text>`, set in the viewer's sans-serif:
//! plotters only estimates their width to lay the chart out, so no font is
//! read or shipped here. Its SVG backend writes sizes at 1/1.24 of those
//! asked for: 16 here is about 13 px.

use std::error::Error;
use std::path::Path;

use plotters::prelude::*;
use serde_json::Value;

/// One line of a chart: a scenario's [`Measure`] (y) at each database
/// round-trip time in milliseconds (x).
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The name the legend shows.
    pub name: String,
    /// `(rtt_ms, measure)`, sorted by round-trip time.
    pub points: Vec<(f64, f64)>,
}

/// What a network chart plots against the round-trip time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// Requests per second: a point's `rps`.
    Throughput,
    /// The database's CPU per request in microseconds: a point's
    /// `db_cpu_us`, what the SQL database's processes spent over the
    /// requests answered (not the peer's Redis).
    DatabaseCpu,
}

impl Measure {
    /// The point's field that holds it, by scenario.
    fn field(self) -> &'static str {
        match self {
            Self::Throughput => "rps",
            Self::DatabaseCpu => "db_cpu_us",
        }
    }

    /// The y axis' description.
    pub fn axis(self) -> &'static str {
        match self {
            Self::Throughput => "requests per second",
            Self::DatabaseCpu => "database CPU per request (µs)",
        }
    }
}

/// The report's scenarios, in the order charted, with the names shown.
const SCENARIOS: [(&str, &str); 5] = [
    ("baseline", "plain"),
    ("idempotent", "idempotent"),
    ("replay", "replay"),
    ("two_phase", "two-phase recipe"),
    ("peer", "peer (idempotent 0.3 + Redis)"),
];

/// Colours told apart by most colour-blind readers too (Okabe-Ito), one per
/// scenario, in [`SCENARIOS`]' order.
const COLOURS: [RGBColor; 5] = [
    RGBColor(0, 0, 0),
    RGBColor(0, 114, 178),
    RGBColor(0, 158, 115),
    RGBColor(230, 159, 0),
    RGBColor(204, 121, 167),
];

/// The series of the report's `network` points for one engine, statement
/// count and concurrency: `measure` of each scenario that has a point, in
/// a fixed order (plain, idempotent, replay, two-phase recipe, peer).
pub fn network_series(
    report: &Value,
    engine: &str,
    statements: u32,
    concurrency: usize,
    measure: Measure,
) -> Vec<Series> {
    let points: Vec<&Value> = report["network"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|point| {
            point["engine"].as_str() == Some(engine)
                && point["statements"].as_u64() == Some(u64::from(statements))
                && point["concurrency"].as_u64() == u64::try_from(concurrency).ok()
        })
        .collect();
    SCENARIOS
        .iter()
        .filter_map(|&(scenario, name)| {
            let mut line: Vec<(f64, f64)> = points
                .iter()
                .filter_map(|point| {
                    let value = point[measure.field()][scenario].as_f64()?;
                    Some((point["rtt_ms"].as_f64()?, value))
                })
                .filter(|(rtt, value)| rtt.is_finite() && value.is_finite())
                .collect();
            line.sort_by(|a, b| a.0.total_cmp(&b.0));
            (!line.is_empty()).then(|| Series {
                name: name.to_owned(),
                points: line,
            })
        })
        .collect()
}

/// Draws `series` as lines with point markers to an SVG file at `path`,
/// 720x420: round-trip time on x, `measure` on y from 0, and a legend of
/// the series' names.
pub fn write_svg(
    path: &Path,
    title: &str,
    measure: Measure,
    series: &[Series],
) -> Result<(), Box<dyn Error>> {
    let axes = Axes {
        x: "database round-trip time (ms)",
        y: measure.axis(),
    };
    write_svg_with(path, title, &axes, series)
}

/// The descriptions of a chart's axes.
#[derive(Debug, Clone, Copy)]
pub struct Axes<'a> {
    /// Under the x axis.
    pub x: &'a str,
    /// Beside the y axis.
    pub y: &'a str,
}

/// As [`write_svg`], with the axes described by `axes` (any quantities,
/// both from 0): the relay benchmark's latency distributions.
pub fn write_svg_with(
    path: &Path,
    title: &str,
    axes: &Axes<'_>,
    series: &[Series],
) -> Result<(), Box<dyn Error>> {
    let points = series.iter().flat_map(|line| line.points.iter());
    let (x_max, y_max) = points.fold((0.0_f64, 0.0_f64), |(x, y), &(rtt, rps)| {
        (x.max(rtt), y.max(rps))
    });
    // Headroom above the highest line keeps the legend off it.
    let (x_max, y_max) = (
        if x_max > 0.0 { x_max * 1.05 } else { 1.0 },
        if y_max > 0.0 { y_max * 1.25 } else { 1.0 },
    );

    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(12)
        .x_label_area_size(42)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .x_desc(axes.x)
        .y_desc(axes.y)
        .y_label_formatter(&|y| {
            if y_max >= 20.0 {
                format!("{y:.0}")
            } else {
                format!("{y:.1}")
            }
        })
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 18))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.1))
        .draw()?;

    for (line, colour) in series.iter().zip(COLOURS.iter().cycle()) {
        let style = colour.filled().stroke_width(2);
        chart
            .draw_series(LineSeries::new(line.points.iter().copied(), style).point_size(3))?
            .label(line.name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.4))
        .draw()?;
    root.present()?;
    Ok(())
}
