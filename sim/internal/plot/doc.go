// Package plot draws the benchmark's PNG figures with the standard library's image/png and
// golang.org/x/image (antialiased vector paths, the Go fonts): a TTFT CDF per arm on a
// logarithmic time axis and execution-mode shares per arm as stacked bars.
package plot
