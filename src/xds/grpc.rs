//! ADS's gRPC framing, by hand on the response side: each response goes to HTTP/2 as its 5-byte
//! gRPC prefix and its segments (`wire::Encoded`), so a block shared by many responses is written
//! from the one copy every stream references, never copied into a per-stream encode buffer (what
//! tonic's codec does). Requests are decoded by tonic's `Streaming`.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use http_body::Frame;
use tokio::sync::mpsc;
use tonic::codegen::{http, Body, StdError};
use tonic::metadata::MetadataMap;
use tonic::{Request, Status, Streaming};

use super::wire::{Encoded, ProstDecoder};

/// A first segment this small travels in one frame with the prefix (one copy of a few bytes
/// instead of an extra HTTP/2 frame).
const JOINED_WITH_PREFIX: usize = 4096;

/// The gRPC request of an HTTP/2 request, its messages decoded as `Req`.
pub fn request<Req, B>(request: http::Request<B>) -> Request<Streaming<Req>>
where
    Req: prost::Message + Default + Send + 'static,
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    let (parts, body) = request.into_parts();
    let messages = Streaming::new_request(ProstDecoder::<Req>::default(), body, None, None);
    Request::from_parts(
        MetadataMap::from_headers(parts.headers),
        parts.extensions,
        messages,
    )
}

/// The HTTP/2 response carrying what `responses` yields, ended by the status trailers.
pub fn response(
    responses: mpsc::Receiver<Result<Encoded, Status>>,
) -> http::Response<tonic::body::Body> {
    let mut response = http::Response::new(tonic::body::Body::new(ResponseBody {
        responses,
        pending: VecDeque::new(),
        ended: false,
    }));
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    response
}

struct ResponseBody {
    responses: mpsc::Receiver<Result<Encoded, Status>>,
    /// Segments of the message being written.
    pending: VecDeque<Bytes>,
    ended: bool,
}

impl ResponseBody {
    /// The first frame of a message: its prefix (uncompressed, length), joined with a small first
    /// segment; the other segments are queued as they are.
    fn start(&mut self, message: Encoded) -> Bytes {
        let length = message.len();
        let mut segments = message.segments().into_iter().peekable();
        let joined = segments
            .next_if(|s| s.len() <= JOINED_WITH_PREFIX)
            .unwrap_or_default();
        let mut first = BytesMut::with_capacity(5 + joined.len());
        first.put_u8(0);
        // A response is far below 4 GiB: resources are bounded in size and number.
        first.put_u32(u32::try_from(length).unwrap_or(u32::MAX));
        first.put_slice(&joined);
        self.pending.extend(segments.filter(|s| !s.is_empty()));
        first.freeze()
    }

    fn trailers(status: &Status) -> Frame<Bytes> {
        let mut trailers = http::HeaderMap::new();
        if let Err(e) = status.add_header(&mut trailers) {
            let _ = Status::internal(e.message().to_string()).add_header(&mut trailers);
        }
        Frame::trailers(trailers)
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(segment) = self.pending.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(segment))));
        }
        if self.ended {
            return Poll::Ready(None);
        }
        match self.responses.poll_recv(cx) {
            Poll::Ready(Some(Ok(message))) => {
                let first = self.start(message);
                Poll::Ready(Some(Ok(Frame::data(first))))
            }
            Poll::Ready(Some(Err(status))) => {
                self.ended = true;
                Poll::Ready(Some(Ok(Self::trailers(&status))))
            }
            Poll::Ready(None) => {
                self.ended = true;
                Poll::Ready(Some(Ok(Self::trailers(&Status::ok("")))))
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn messages_are_framed_and_the_stream_ends_with_its_status() {
        let (tx, rx) = mpsc::channel(4);
        let big = Bytes::from(vec![7u8; JOINED_WITH_PREFIX + 1]);
        let message: Encoded = vec![Bytes::from_static(b"ab"), big.clone()].into();
        tx.send(Ok(message)).await.unwrap();
        tx.send(Err(Status::unavailable("going away")))
            .await
            .unwrap();
        drop(tx);
        let mut body = response(rx).into_body();
        let mut data = Vec::new();
        let mut trailers = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.unwrap();
            match frame.into_data() {
                Ok(bytes) => data.extend_from_slice(&bytes),
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        let length = 2 + big.len();
        assert_eq!(data[0], 0, "uncompressed");
        assert_eq!(
            u32::from_be_bytes(data[1..5].try_into().unwrap()) as usize,
            length
        );
        assert_eq!(&data[5..7], b"ab");
        assert_eq!(data.len(), 5 + length);
        let trailers = trailers.expect("trailers");
        assert_eq!(trailers["grpc-status"], "14");
    }
}
