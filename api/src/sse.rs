//! Server-sent events: a channel whose events become a streamed response,
//! and the two shapes of event the dialects send.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::Value;

pub(super) type EventSender = tokio::sync::mpsc::Sender<Result<Event, Infallible>>;

/// A channel whose events become an SSE response (with keep-alive
/// comments during long prefills).
pub(super) fn sse_channel() -> (EventSender, Response) {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(256);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|event| (event, rx))
    });
    let response = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
        .into_response();
    (tx, response)
}

/// A named SSE event with a JSON body.
pub(super) fn named((name, value): (&str, Value)) -> Result<Event, Infallible> {
    Ok(Event::default().event(name).data(value.to_string()))
}

/// An unnamed SSE event with a JSON body.
pub(super) fn data(value: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(value.to_string()))
}
