//! The pages' markup: every control labelled, ids unique, values escaped,
//! no script.

use std::time::{Duration, SystemTime};

use http::StatusCode;

use super::{KeyView, Overview, Viewer, key, overview};
use crate::admin::resolution::FormAsk;
use crate::backend::{KeyInfo, KeyState};
use crate::resolve::{ResolutionRecord, Uncertainty};

fn uncertain(scope: &str) -> KeyInfo {
    let now = SystemTime::now();
    KeyInfo {
        scope: scope.to_owned(),
        key: "pay-<b>7</b>".to_owned(),
        state: KeyState::Uncertain,
        fingerprint: "ab".repeat(32),
        status: None,
        method: Some("POST".to_owned()),
        path: Some("/v1/payments".to_owned()),
        created: now - Duration::from_secs(90),
        expires: now + Duration::from_secs(86_000),
        leased: false,
        lease_until: Some(now - Duration::from_secs(20)),
        phases: vec!["pending".to_owned()],
        external: true,
        begun: vec!["charge".to_owned()],
        attempts: 2,
        uncertain: Some(Uncertainty {
            since: now - Duration::from_secs(15),
            reason: "attempts_exhausted".to_owned(),
            step: None,
        }),
        resolutions: vec![ResolutionRecord {
            at: now - Duration::from_secs(3600),
            outcome: "retry".to_owned(),
            status: None,
            by: Some("<ana>".to_owned()),
            note: None,
        }],
        unreadable: false,
    }
}

async fn body(response: axum::response::Response) -> String {
    let bytes = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// Every `id="..."` once; every visible control's id named by a label.
fn accessible(html: &str) {
    let ids: Vec<&str> = html
        .split(" id=\"")
        .skip(1)
        .map(|rest| rest.split('"').next().unwrap())
        .collect();
    let mut unique = ids.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), ids.len(), "duplicate ids: {ids:?}");
    for control in html.split('<').filter(|tag| {
        (tag.starts_with("input ") && !tag.contains("type=\"hidden\""))
            || tag.starts_with("textarea ")
    }) {
        let id = control
            .split(" id=\"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .unwrap_or_else(|| panic!("a control without an id: <{control}"));
        assert!(
            html.contains(&format!("<label for=\"{id}\">")),
            "no label for {id}"
        );
    }
    assert!(!html.contains("<script"), "{html}");
    for landmark in [
        "<header",
        "<nav aria-label=\"Main\"",
        "<main id=\"main\"",
        "<h1>",
    ] {
        assert!(html.contains(landmark), "{landmark}");
    }
}

#[tokio::test]
async fn an_uncertain_keys_page_offers_its_three_resolutions() {
    let viewer = Viewer {
        csrf: "f00d".to_owned(),
        session: true,
    };
    let info = uncertain("acct_<1>");
    let ask = FormAsk {
        outcome: "completed".to_owned(),
        status: "2O1".to_owned(),
        body: "{\"id\": \"</textarea><script>\"}".to_owned(),
        ..FormAsk::default()
    };
    let view = KeyView {
        info: &info,
        now: SystemTime::now(),
        notice: None,
        refused: Some(("status \"2O1\" is not an HTTP status".to_owned(), &ask)),
    };
    let response = key(&viewer, &view, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(response.status(), 422);
    let html = body(response).await;
    accessible(&html);
    for outcome in ["completed", "not_started", "retry"] {
        assert!(
            html.contains(&format!("name=\"outcome\" value=\"{outcome}\"")),
            "{outcome}"
        );
    }
    assert_eq!(
        html.matches("name=\"csrf\" value=\"f00d\"").count(),
        4,
        "3 forms and sign-out"
    );
    // What the refused form had, kept and escaped.
    assert!(html.contains("value=\"2O1\""));
    assert!(html.contains("&lt;/textarea&gt;&lt;script&gt;"));
    assert!(html.contains("acct_&lt;1&gt;") && html.contains("pay-&lt;b&gt;7&lt;/b&gt;"));
    assert!(html.contains("&lt;ana&gt;"));
    assert!(html.contains("attempts_exhausted") && html.contains("<code>charge</code>"));
    // No forget form for an uncertain key.
    assert!(!html.contains("/admin/key/forget"));
}

#[tokio::test]
async fn the_overview_lists_each_state_in_a_table_with_headers() {
    let viewer = Viewer {
        csrf: String::new(),
        session: false,
    };
    let view = Overview {
        now: SystemTime::now(),
        notice: Some("Forgotten: the key's next request runs afresh."),
        uncertain: Ok(vec![uncertain("acct_1")]),
        in_flight: Ok(Vec::new()),
        abandoned: Err("the key store failed".to_owned()),
        search: Some(("<acct>".to_owned(), 50, Ok(vec![uncertain("<acct>")]))),
        outbox: Ok(crate::outbox::OutboxStatus::default()),
        completer: None,
        relay: None,
    };
    let html = body(overview(&viewer, &view)).await;
    accessible(&html);
    assert!(html.contains("<th scope=\"col\">Reason</th>"));
    assert!(html.contains(
        "<th scope=\"row\"><a href=\"/admin/key?scope=acct_1&amp;key=pay-%3Cb%3E7%3C%2Fb%3E\">"
    ));
    assert!(html.contains("role=\"alert\">Could not read them: the key store failed"));
    assert!(html.contains("value=\"&lt;acct&gt;\""));
    // A bearer has no session to sign out of.
    assert!(!html.contains("/admin/logout"));
}
