//! The throughput report's network charts (`idem_tests::chart`): the points
//! picked from a report, and the SVG drawn from them.

use idem_tests::chart::{Measure, Series, network_series, write_svg};
use serde_json::{Value, json};

/// A report's `network` points: postgres at 16 clients over three
/// round-trip times (out of order, `peer` run at one only), plus points of
/// another engine, statement count and concurrency that must be left out.
/// A point's database CPU per request is a tenth of its req/s' figure.
fn report() -> Value {
    let point = |engine: &str, rtt: f64, statements: u32, concurrency: usize, rps: Value| {
        let cpu: serde_json::Map<String, Value> = rps
            .as_object()
            .unwrap()
            .iter()
            .map(|(scenario, rps)| (scenario.clone(), json!(rps.as_f64().unwrap() / 10.0)))
            .collect();
        json!({
            "engine": engine, "rtt_ms": rtt, "statements": statements,
            "concurrency": concurrency, "rps": rps, "db_cpu_us": cpu, "rounds": 3,
        })
    };
    let all = |scale: f64| {
        json!({
            "baseline": 4100.0 * scale, "idempotent": 3200.0 * scale,
            "replay": 11000.0 * scale, "two_phase": 2700.0 * scale,
        })
    };
    let mut with_peer = all(1.0);
    with_peer["peer"] = json!(3500.0);
    json!({
        "network": [
            point("postgres", 2.0, 1, 16, all(0.25)),
            point("postgres", 0.5, 1, 16, with_peer),
            point("postgres", 1.0, 1, 16, all(0.5)),
            point("mysql", 1.0, 1, 16, all(9.0)),
            point("postgres", 1.0, 4, 16, all(9.0)),
            point("postgres", 1.0, 1, 64, all(9.0)),
        ]
    })
}

#[test]
fn picks_one_series_per_scenario_in_order_sorted_by_round_trip() {
    let series = network_series(&report(), "postgres", 1, 16, Measure::Throughput);
    let names: Vec<&str> = series.iter().map(|line| line.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "plain",
            "idempotent",
            "replay",
            "two-phase recipe",
            "peer (idempotent 0.3 + Redis)"
        ]
    );
    assert_eq!(
        series[0],
        Series {
            name: "plain".into(),
            points: vec![(0.5, 4100.0), (1.0, 2050.0), (2.0, 1025.0)],
        }
    );
    assert_eq!(series[4].points, [(0.5, 3500.0)]);
}

#[test]
fn the_database_cpu_series_picks_the_same_points() {
    let cpu = network_series(&report(), "postgres", 1, 16, Measure::DatabaseCpu);
    let rps = network_series(&report(), "postgres", 1, 16, Measure::Throughput);
    assert_eq!(cpu.len(), rps.len());
    for (cpu, rps) in cpu.iter().zip(&rps) {
        assert_eq!(cpu.name, rps.name);
        let scaled: Vec<(f64, f64)> = rps.points.iter().map(|&(x, y)| (x, y / 10.0)).collect();
        assert_eq!(cpu.points, scaled, "{}", cpu.name);
    }
    // A point without the measure (an older report) adds nothing.
    let mut older = report();
    for point in older["network"].as_array_mut().unwrap() {
        point.as_object_mut().unwrap().remove("db_cpu_us");
    }
    assert!(network_series(&older, "postgres", 1, 16, Measure::DatabaseCpu).is_empty());
}

#[test]
fn a_report_without_matching_points_has_no_series() {
    for measure in [Measure::Throughput, Measure::DatabaseCpu] {
        assert!(network_series(&report(), "sqlite", 1, 16, measure).is_empty());
        assert!(network_series(&json!({}), "postgres", 1, 16, measure).is_empty());
    }
}

#[test]
fn the_svg_carries_the_title_axes_and_every_legend_name() {
    for measure in [Measure::Throughput, Measure::DatabaseCpu] {
        let series = network_series(&report(), "postgres", 1, 16, measure);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("network.svg");
        write_svg(&path, "postgres, 1 statement, 16 clients", measure, &series).unwrap();

        let svg = std::fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"), "not an SVG: {svg:.200}");
        assert!(svg.trim_end().ends_with("</svg>"));
        let texts = texts(&svg);
        for text in [
            "postgres, 1 statement, 16 clients",
            "database round-trip time (ms)",
            measure.axis(),
        ]
        .into_iter()
        .chain(series.iter().map(|line| line.name.as_str()))
        {
            assert!(texts.contains(&text), "no text {text:?} among {texts:?}");
        }
    }
}

/// The contents of the SVG's `<text>` elements, trimmed.
fn texts(svg: &str) -> Vec<&str> {
    svg.split("<text")
        .skip(1)
        .filter_map(|element| {
            let (_, rest) = element.split_once('>')?;
            let (text, _) = rest.split_once("</text>")?;
            Some(text.trim())
        })
        .collect()
}

#[test]
fn an_empty_chart_still_draws() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("empty.svg");
    write_svg(&path, "nothing measured", Measure::Throughput, &[]).unwrap();
    assert!(std::fs::read_to_string(&path).unwrap().contains("<svg"));
}
