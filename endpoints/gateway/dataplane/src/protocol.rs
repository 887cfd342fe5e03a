// Written by scripts/dataplane_protocol.py from ../protocol.toml (the one definition of the gateway's
// protocol): do not edit; change the TOML and run `make dataplane`.
#![allow(dead_code)]

pub const FINGERPRINT: &str = "ef531d53b39de3046cff0421dfa8ff8088179def9c5fb9fdfb704a6f738d438e";
pub const TAIL_BYTES: usize = 8192;
pub const EAGER_BODY: u64 = 65536;
pub const STREAM_ERROR: &[u8] = "data: {\"error\": {\"message\": \"The replica failed mid-stream.\", \"type\": \"bad_gateway\"}}\n\n".as_bytes();
pub const FORWARDED_HEADERS: [&str; 6] = ["accept", "user-agent", "x-request-id", "traceparent", "tracestate", "baggage"];
pub const ENGINE_HEADERS: [&str; 2] = ["x-data-parallel-rank", "x-vllm-priority"];
pub const ARGUMENTS: [&str; 11] = ["--listen", "--control-fd", "--connect-timeout", "--read-timeout", "--idle-timeout", "--max-body", "--header-timeout", "--idle-client-timeout", "--body-timeout", "--max-connections", "--max-connections-per-address"];
// to gateway
pub const HELLO: u8 = b'H'; // first frame of all, request id 0: the data path's protocol fingerprint
pub const REQUEST: u8 = b'Q'; // method, path, authorization, x-api-key, body (1: it follows, 0: ask with send_body) -> answer, send_body or forward
pub const BODY: u8 = b'D'; // the request body asked for ("ok" with the body, or "too_large") -> answer or forward
pub const ANSWERED: u8 = b'S'; // status, ttft_us, events, streamed, content type; the answer's tail, or all of it if asked (then -> answer)
pub const UNREACHABLE: u8 = b'E'; // the replica could not be reached (error) -> forward again, or answer
pub const FAILED: u8 = b'X'; // the replica failed before an answer (error) -> answer
pub const CUT_SHORT: u8 = b'M'; // failed mid-answer (streamed, ttft_us, events, error) -> answer when not streamed
pub const LEFT: u8 = b'L'; // the client left
// from gateway
pub const ANSWER: u8 = b'A'; // status, content type, retry-after, notice; body
pub const SEND_BODY: u8 = b'B'; // send me the request body (read only now, after the key)
pub const FORWARD: u8 = b'F'; // url, bearer token, whole (1: give me the answer back), engine headers allowed, notice; the body to send
