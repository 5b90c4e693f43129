//! Text around the model: [`tokenizer`], [`chat_template`] (messages to a
//! prompt), and on the way out [`utf8_stream`] (whole characters),
//! [`stop`] (stop strings) and [`output_parser`] (thinking and tool calls);
//! [`tools`] gives tools to every model and writes the grammar of
//! `tool_choice`.

pub mod chat_template;
pub mod output_parser;
pub mod stop;
pub mod tokenizer;
pub mod tools;
pub mod utf8_stream;
