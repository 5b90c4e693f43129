//! Text around the model: [`tokenizer`], [`chat_template`] (messages to a
//! prompt), and on the way out [`utf8_stream`] (whole characters),
//! [`stop`] (stop strings) and [`output_parser`] (thinking and tool calls).

pub mod chat_template;
pub mod output_parser;
pub mod stop;
pub mod tokenizer;
pub mod utf8_stream;
