// Package toolcall splits a chat answer into reasoning, content and tool calls as SGLang
// 0.5.23's reasoning parsers and tool-call detectors do (--reasoning-parser, --tool-call-parser).
package toolcall
