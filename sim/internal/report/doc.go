// Package report turns kvc-bench's per-request records into per-arm statistics: summary.json
// (the fixed field set of the demo) and report.md (tables by mode, reason and error kind, bytes
// moved, the demo's target checks, and what is modeled versus real).
package report
