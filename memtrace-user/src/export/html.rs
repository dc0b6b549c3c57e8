//! `--html PATH`: one self-contained HTML file that works offline. The run's summary (the same
//! JSON as `--summary`, with every stack, timeline and peak) is embedded as data, and a small
//! script of memtrace's own (html/report.js, no library, no network) draws the timeline per
//! process, a treemap of memory by level, flamegraphs of live and allocated bytes that zoom on
//! click, and the tables of leaks, temporary allocations and the heap peak. Flamegraphs are
//! merged into a tree and drawn on a canvas, skipping frames narrower than a pixel, so a run of
//! 100,000 stacks stays quick.

use std::{io::Write, path::Path};

use anyhow::Result;

use super::{exporter::Exporter, output_file::OutputFile, summary::Summary};
use crate::model::{Model, RunEnd};

const SCRIPT: &str = include_str!("html/report.js");
const STYLE: &str = include_str!("html/report.css");

/// Nothing may be fetched: scripts and styles are inline, images are drawn.
const CONTENT_SECURITY_POLICY: &str =
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:";

pub struct HtmlFile {
    file: OutputFile,
    /// How many leaking stacks the summary embedded lists per process.
    top: usize,
}

impl HtmlFile {
    pub fn create(path: &Path, top: usize) -> Result<Self> {
        Ok(Self { file: OutputFile::create(path, "HTML report", "--html")?, top })
    }
}

impl Exporter for HtmlFile {
    fn written(&self) -> Option<String> {
        Some(format!("HTML report written to {}", self.file.path().display()))
    }

    fn finish(&mut self, model: &Model, end: RunEnd) -> Result<()> {
        let data = serde_json::to_string(&Summary::of(model, end, self.top))?;
        let page = render(&data);
        self.file.commit(|file| file.write_all(page.as_bytes()))
    }
}

/// The page around the run's data (a JSON text).
fn render(data: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta http-equiv=\"Content-Security-Policy\" content=\"{CONTENT_SECURITY_POLICY}\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <title>memtrace report</title>\n<style>\n{STYLE}</style>\n</head>\n<body>\n\
         <noscript>This report draws itself with JavaScript; the data is in the JSON below.</noscript>\n\
         <script type=\"application/json\" id=\"memtrace-data\">{}</script>\n\
         <script>\n{SCRIPT}</script>\n</body>\n</html>\n",
        script_safe(data)
    )
}

/// JSON that cannot end the script element it sits in: every `<` (only ever inside a string) is
/// written as the escape `\u003c`, which JSON.parse reads back as `<`.
fn script_safe(json: &str) -> String {
    json.replace('<', "\\u003c")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_cannot_close_its_script_element() {
        let data = serde_json::json!({"comm": "</script><script>alert(1)</script>"}).to_string();
        let page = render(&data);
        assert_eq!(page.matches("</script>").count(), 2, "only the page's own two script ends");
        let start = page.find("id=\"memtrace-data\">").unwrap() + "id=\"memtrace-data\">".len();
        let end = start + page[start..].find("</script>").unwrap();
        let back: serde_json::Value = serde_json::from_str(&page[start..end]).unwrap();
        assert_eq!(back["comm"], "</script><script>alert(1)</script>");
    }

    #[test]
    fn the_page_asks_for_nothing_outside_itself() {
        let page = render("{}");
        for outside in ["http:", "https:", "src=", "href=", "@import", "url("] {
            assert!(!page.contains(outside), "the page refers to something outside it: {outside}");
        }
    }
}
