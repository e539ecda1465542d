//! The overview (keys by state, a scope's recent keys, the outbox, the
//! background tasks) and one key's page with its forms.

use std::time::SystemTime;

use axum::response::Response;
use http::StatusCode;
use maud::{Markup, html};

use super::{Viewer, respond};
use crate::admin::api::state_name;
use crate::admin::format::{duration, encode, iso, key_json, key_page, relative, utc};
use crate::admin::resolution::{FormAsk, MAX_BY, MAX_NOTE};
use crate::backend::{KeyInfo, KeyState};
use crate::completer::CompleterRun;
use crate::outbox::OutboxStatus;
use crate::passes::LastPass;
use crate::passes::RelayRun;

/// What the overview shows; each part read on its own, so one failing
/// read leaves the rest.
pub(in crate::admin) struct Overview {
    pub(in crate::admin) now: SystemTime,
    pub(in crate::admin) notice: Option<&'static str>,
    pub(in crate::admin) uncertain: Result<Vec<KeyInfo>, String>,
    pub(in crate::admin) in_flight: Result<Vec<KeyInfo>, String>,
    pub(in crate::admin) abandoned: Result<Vec<KeyInfo>, String>,
    /// The scope searched for, its limit and its recent keys.
    pub(in crate::admin) search: Option<(String, u32, Result<Vec<KeyInfo>, String>)>,
    pub(in crate::admin) outbox: Result<OutboxStatus, String>,
    pub(in crate::admin) completer: Option<LastPass<CompleterRun>>,
    pub(in crate::admin) relay: Option<LastPass<RelayRun>>,
}

/// A time as `<time>`: UTC, and how far from now.
fn when(time: SystemTime, now: SystemTime) -> Markup {
    html! { time datetime=(iso(time)) title=(utc(time)) { (relative(time, now)) } }
}

fn request(info: &KeyInfo) -> Markup {
    html! {
        @match (&info.method, &info.path) {
            (Some(method), Some(path)) => code { (method) " " (path) },
            _ => span.hint { "not kept" },
        }
    }
}

fn names(names: &[String]) -> Markup {
    html! {
        @if names.is_empty() {
            span.hint { "none" }
        } @else {
            @for (i, name) in names.iter().enumerate() {
                @if i > 0 { ", " }
                code { (name) }
            }
        }
    }
}

fn key_link(info: &KeyInfo) -> Markup {
    html! { a href=(key_page(&info.scope, &info.key)) { code { (info.key) } } }
}

/// A table of keys with a caption, in a region that scrolls sideways on a
/// narrow screen (focusable, so a keyboard scrolls it too); `None.` when
/// there are none; what went wrong when the read failed.
fn table(
    id: &str,
    caption: &str,
    keys: &Result<Vec<KeyInfo>, String>,
    head: &[&str],
    row: impl Fn(&KeyInfo) -> Markup,
) -> Markup {
    html! {
        @match keys {
            Err(error) => p.error role="alert" { "Could not read them: " (error) },
            Ok(keys) if keys.is_empty() => p { "None." },
            Ok(keys) => div.table role="region" aria-labelledby=(id) tabindex="0" {
                table {
                    caption #(id) { (caption) " (" (keys.len()) ")" }
                    thead { tr { @for name in head { th scope="col" { (name) } } } }
                    tbody { @for info in keys { (row(info)) } }
                }
            },
        }
    }
}

/// `GET /admin`.
pub(in crate::admin) fn overview(viewer: &Viewer, view: &Overview) -> Response {
    let content = html! {
        h1 { "Idempotency keys" }
        @if let Some(notice) = view.notice { p.notice role="status" { (notice) } }
        (by_state(view))
        (search(view))
        (outbox(&view.outbox, view.now))
        (tasks(view))
    };
    respond(StatusCode::OK, "Overview", Some(viewer), content)
}

/// The uncertain, in-flight and abandoned keys, each in its section.
fn by_state(view: &Overview) -> Markup {
    let now = view.now;
    let count = |keys: &Result<Vec<KeyInfo>, String>| match keys {
        Ok(keys) => keys.len().to_string(),
        Err(_) => "?".to_owned(),
    };
    html! {
    section aria-labelledby="uncertain" {
        h2 #uncertain { "Uncertain (" (count(&view.uncertain)) ")" }
        p.hint {
            "Nothing runs for these keys, and every request with one is told its outcome "
            "is uncertain, until you resolve it: open the key to say what happened."
        }
        (table("uncertain-keys", "Keys whose outcome is unknown", &view.uncertain,
            &["Scope", "Key", "Request", "Since", "Reason", "Step", "Phases recorded", "External steps begun"],
            |info| html! {
                tr {
                    td { code { (info.scope) } }
                    th scope="row" { (key_link(info)) }
                    td { (request(info)) }
                    td { @if let Some(u) = &info.uncertain { (when(u.since, now)) } }
                    td { @if let Some(u) = &info.uncertain { (u.reason) } }
                    td { @if let Some(step) = info.uncertain.as_ref().and_then(|u| u.step.as_ref()) { code { (step) } } }
                    td { (names(&info.phases)) }
                    td { (names(&info.begun)) }
                }
            }))
    }
    section aria-labelledby="in-flight" {
        h2 #in-flight { "In flight (" (count(&view.in_flight)) ")" }
        p.hint { "An attempt holds each of these keys; a retry meanwhile is answered 409." }
        (table("in-flight-keys", "Keys an attempt holds", &view.in_flight,
            &["Scope", "Key", "Request", "Lease ends", "Attempts", "Phases recorded"],
            |info| html! {
                tr {
                    td { code { (info.scope) } }
                    th scope="row" { (key_link(info)) }
                    td { (request(info)) }
                    td { @if let Some(until) = info.lease_until { (when(until, now)) } }
                    td { (info.attempts) }
                    td { (names(&info.phases)) }
                }
            }))
    }
    section aria-labelledby="abandoned" {
        h2 #abandoned { "Abandoned (" (count(&view.abandoned)) ")" }
        p.hint {
            "Their attempt stopped with its lease; the completer (or a client's retry) "
            "resumes each from its last recorded phase."
        }
        (table("abandoned-keys", "Keys waiting to be resumed", &view.abandoned,
            &["Scope", "Key", "Request", "Attempts", "Next run from", "Phases recorded"],
            |info| html! {
                tr {
                    td { code { (info.scope) } }
                    th scope="row" { (key_link(info)) }
                    td { (request(info)) }
                    td { (info.attempts) }
                    td { @if let Some(until) = info.lease_until { (when(until, now)) } }
                    td { (names(&info.phases)) }
                }
            }))
    }
    }
}

/// The background tasks' last passes.
fn tasks(view: &Overview) -> Markup {
    let now = view.now;
    html! {
    section aria-labelledby="tasks" {
        h2 #tasks { "Background tasks" }
        p.hint { "Their last pass in this process." }
        dl.facts {
            dt { "Completer" }
            dd { (pass(&view.completer, now, |run| format!(
                "resumed {}, completed {}, made uncertain {}, released {}",
                run.resumed, run.completed, run.uncertain, run.released))) }
            dt { "Outbox relay" }
            dd { (pass(&view.relay, now, |run| format!(
                "delivered {}, failed {}, deferred {}", run.delivered, run.failed, run.deferred))) }
        }
    }
    }
}

fn search(view: &Overview) -> Markup {
    let (scope, limit) = match &view.search {
        Some((scope, limit, _)) => (scope.as_str(), *limit),
        None => ("", crate::admin::api::DEFAULT_LIMIT),
    };
    html! {
        section aria-labelledby="find" {
            h2 #find { "A scope's recent keys" }
            form.search method="get" action="/admin" role="search" aria-labelledby="find" {
                div {
                    label for="scope" { "Scope" }
                    input #scope type="search" name="scope" value=(scope) required
                        autocomplete="off" spellcheck="false";
                }
                div {
                    label for="limit" { "At most" }
                    input #limit type="number" name="limit" value=(limit) min="1" max="1000"
                        inputmode="numeric";
                }
                button type="submit" { "Show keys" }
            }
            @if let Some((scope, _, keys)) = &view.search {
                (table("recent-keys", &format!("The newest keys of scope {scope}"), keys,
                    &["Key", "State", "Status", "Created", "Expires", "Request"],
                    |info| html! {
                        tr {
                            th scope="row" { (key_link(info)) }
                            td { (state(info.state)) }
                            td { @if let Some(status) = info.status { (status) } }
                            td { (when(info.created, view.now)) }
                            td { (when(info.expires, view.now)) }
                            td { (request(info)) }
                        }
                    }))
            }
        }
    }
}

fn state(state: KeyState) -> Markup {
    html! {
        @if state == KeyState::Uncertain {
            span.state.uncertain { (state_name(state)) }
        } @else {
            span.state { (state_name(state)) }
        }
    }
}

fn outbox(status: &Result<OutboxStatus, String>, now: SystemTime) -> Markup {
    html! {
        section aria-labelledby="outbox" {
            h2 #outbox { "Outbox" }
            @match status {
                Err(error) => p.error role="alert" { "Could not read it: " (error) },
                Ok(status) => {
                    p { (status.pending) " messages wait for delivery." }
                    @if status.failing.is_empty() {
                        p { "No scope's delivery is failing." }
                    } @else {
                        div.table role="region" aria-labelledby="failing" tabindex="0" {
                            table {
                                caption #failing { "Scopes whose delivery is failing" }
                                thead { tr {
                                    th scope="col" { "Scope" }
                                    th scope="col" { "Waiting" }
                                    th scope="col" { "Failed deliveries" }
                                    th scope="col" { "Last error" }
                                    th scope="col" { "Next attempt" }
                                } }
                                tbody { @for failing in &status.failing { tr {
                                    th scope="row" { code { (failing.scope) } }
                                    td { (failing.pending) }
                                    td { (failing.attempts) }
                                    td { @if let Some(error) = &failing.last_error { (error) } }
                                    td { @if let Some(next) = failing.next_attempt { (when(next, now)) } }
                                } } }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn pass<R>(pass: &Option<LastPass<R>>, now: SystemTime, say: impl Fn(&R) -> String) -> Markup {
    html! {
        @match pass {
            None => "no pass yet",
            Some(pass) => {
                (when(pass.at, now)) ", took " (duration(pass.took)) ": "
                @match &pass.result {
                    Ok(run) => (say(run)),
                    Err(error) => span.uncertain { "failed: " (error) },
                }
            }
        }
    }
}

/// One key's page: its facts, resolutions and the forms that apply.
pub(in crate::admin) struct KeyView<'a> {
    pub(in crate::admin) info: &'a KeyInfo,
    pub(in crate::admin) now: SystemTime,
    pub(in crate::admin) notice: Option<&'static str>,
    /// Why the last form changed nothing, with what it asked.
    pub(in crate::admin) refused: Option<(String, &'a FormAsk)>,
}

/// `GET /admin/key`, answered with `status`.
pub(in crate::admin) fn key(viewer: &Viewer, view: &KeyView<'_>, status: StatusCode) -> Response {
    let info = view.info;
    let now = view.now;
    let scope_page = format!("/admin?scope={}#find", encode(&info.scope));
    let content = html! {
        p { a href="/admin" { "Overview" } " › " a href=(scope_page) { "Scope " code { (info.scope) } } }
        h1 { "Key " code { (info.key) } }
        @if let Some(notice) = view.notice { p.notice role="status" { (notice) } }
        @if let Some((why, _)) = &view.refused {
            div.error role="alert" { h2 { "Nothing changed" } p { (why) } }
        }
        dl.facts {
            dt { "Scope" } dd { code { (info.scope) } }
            dt { "State" } dd { (state(info.state)) }
            dt { "Response status" } dd { @match info.status { Some(s) => (s), None => span.hint { "none stored" } } }
            dt { "Request" } dd { (request(info)) }
            dt { "Fingerprint" } dd { code { (info.fingerprint) } }
            dt { "Created" } dd { (when(info.created, now)) " (" (utc(info.created)) ")" }
            dt { "Expires" } dd { (when(info.expires, now)) " (" (utc(info.expires)) ")" }
            dt { "Lease" } dd {
                @match (info.leased, info.lease_until) {
                    (true, Some(until)) => { "held, ends " (when(until, now)) }
                    (false, Some(until)) => { "ended " (when(until, now)) }
                    _ => span.hint { "none" },
                }
            }
            dt { "Attempts" } dd { (info.attempts) }
            dt { "External step may have run" } dd { @if info.external { "yes" } @else { "no" } }
            dt { "Phases recorded" } dd { (names(&info.phases)) }
            dt { "External steps begun" } dd { (names(&info.begun)) }
        }
        @if let Some(uncertain) = &info.uncertain {
            h2 { "Why it is uncertain" }
            dl.facts {
                dt { "Since" } dd { (when(uncertain.since, now)) " (" (utc(uncertain.since)) ")" }
                dt { "Reason" } dd { (uncertain.reason) ": " (reason(&uncertain.reason)) }
                @if let Some(step) = &uncertain.step { dt { "Step" } dd { code { (step) } } }
            }
        }
        h2 { "Resolutions" }
        @if info.resolutions.is_empty() {
            p { "None." }
        } @else {
            div.table role="region" aria-labelledby="resolutions" tabindex="0" {
                table {
                    caption #resolutions { "Decisions recorded for this key, oldest first" }
                    thead { tr {
                        th scope="col" { "When" } th scope="col" { "Outcome" } th scope="col" { "Status" }
                        th scope="col" { "By" } th scope="col" { "Note" }
                    } }
                    tbody { @for record in &info.resolutions { tr {
                        th scope="row" { (when(record.at, now)) }
                        td { (record.outcome) }
                        td { @if let Some(status) = record.status { (status) } }
                        td { @if let Some(by) = &record.by { (by) } }
                        td { @if let Some(note) = &record.note { (note) } }
                    } } }
                }
            }
        }
        @if info.state == KeyState::Uncertain { (resolve_forms(viewer, view)) }
        @if matches!(info.state, KeyState::Completed | KeyState::Expired | KeyState::Tombstone) {
            h2 { "Forget" }
            p.hint { "Deletes the key: its next request runs afresh, as a first attempt." }
            form.act method="post" action="/admin/key/forget" {
                (hidden(viewer, info))
                button.danger type="submit" { "Forget this key" }
            }
        }
        p { a href=(key_json(&info.scope, &info.key)) { "This key as JSON" } }
    };
    respond(status, "Key", Some(viewer), content)
}

fn reason(reason: &str) -> &'static str {
    match reason {
        "attempts_exhausted" => "its attempts ran out after an external step may have happened",
        "step_begun" => "a step that must not run twice began without a recorded result",
        _ => "recorded by another version",
    }
}

fn hidden(viewer: &Viewer, info: &KeyInfo) -> Markup {
    html! {
        input type="hidden" name="scope" value=(info.scope);
        input type="hidden" name="key" value=(info.key);
        input type="hidden" name="csrf" value=(viewer.csrf);
    }
}

/// The three resolutions, each its own form; the one refused keeps what
/// was typed into it.
fn resolve_forms(viewer: &Viewer, view: &KeyView<'_>) -> Markup {
    let asked = |outcome: &str| {
        view.refused
            .as_ref()
            .map(|(_, ask)| *ask)
            .filter(|ask| ask.outcome == outcome)
    };
    let done = asked("completed");
    let status = done.map_or("", |ask| ask.status.as_str());
    let body = done.map_or("", |ask| ask.body.as_str());
    html! {
        h2 { "Resolve" }
        p.hint {
            "Find out what happened outside the service (the provider's dashboard, its "
            "report), then record it. Every decision is kept with the key."
        }
        form.act method="post" action="/admin/key/resolve" aria-labelledby="completed-h" {
            h3 #completed-h { "It happened: record its response" }
            (hidden(viewer, view.info))
            input type="hidden" name="outcome" value="completed";
            label for="completed-status" { "Response status" }
            // Text, not `number`: a refused value is shown as typed.
            input #completed-status type="text" name="status" value=(status) required
                inputmode="numeric" pattern="[1-5][0-9][0-9]" size="3"
                aria-describedby="completed-status-hint";
            p.hint #completed-status-hint { "The status every retry will be answered, such as 201." }
            label for="completed-body" { "Response body (JSON)" }
            textarea #completed-body name="body" required spellcheck="false"
                aria-describedby="completed-body-hint" { (body) }
            p.hint #completed-body-hint { "Replayed to every retry of the key, as the handler would have answered." }
            (by_note("completed", asked("completed")))
            button type="submit" { "Record the response" }
        }
        form.act method="post" action="/admin/key/resolve" aria-labelledby="not-started-h" {
            h3 #not-started-h { "It did not happen: release the key" }
            p.hint { "The next retry runs the request afresh, external steps included." }
            (hidden(viewer, view.info))
            input type="hidden" name="outcome" value="not_started";
            (by_note("not_started", asked("not_started")))
            button type="submit" { "Release the key" }
        }
        form.act method="post" action="/admin/key/resolve" aria-labelledby="retry-h" {
            h3 #retry-h { "Try again: hand it back to the completer" }
            p.hint {
                "Resumed from its last recorded phase, its attempts counted afresh; steps "
                "marked begun run again."
            }
            (hidden(viewer, view.info))
            input type="hidden" name="outcome" value="retry";
            (by_note("retry", asked("retry")))
            button type="submit" { "Retry" }
        }
    }
}

fn by_note(form: &str, asked: Option<&FormAsk>) -> Markup {
    let by = asked.map_or("", |ask| ask.by.as_str());
    let note = asked.map_or("", |ask| ask.note.as_str());
    html! {
        label for=(format!("{form}-by")) { "By" }
        input id=(format!("{form}-by")) type="text" name="by" value=(by) maxlength=(MAX_BY)
            autocomplete="name";
        label for=(format!("{form}-note")) { "Note" }
        input id=(format!("{form}-note")) type="text" name="note" value=(note) maxlength=(MAX_NOTE);
    }
}
