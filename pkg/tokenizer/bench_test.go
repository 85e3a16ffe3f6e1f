package tokenizer

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"
)

const promptTokens = 32768

// benchPrompt builds a realistic coding-agent prompt of at least 32K Qwen3 tokens: a chat
// rendered with the model's template whose turns carry Go source files (the standard
// library's net/http, stable for a Go version), prose, JSON tool results and CJK text.
func benchPrompt(tb testing.TB, tok *Tokenizer) string {
	tb.Helper()
	files, _ := filepath.Glob(filepath.Join(runtime.GOROOT(), "src", "net", "http", "*.go")) //nolint:staticcheck // SA1019: this test binary runs where it was built
	if len(files) == 0 {
		files, _ = filepath.Glob(filepath.Join("..", "*", "*.go"))
	}
	sort.Strings(files)
	texts := corpus(tb)
	var msgs []Message
	msgs = append(msgs, Message{Role: "system", Content: "You are a coding agent working in a Go repository. Use the tools to read files; answer concisely.\n\n" + strings.Join(texts[:60], "\n")})
	total := 0
	for i := 0; total < promptTokens; i++ {
		src, err := os.ReadFile(files[i%len(files)])
		if err != nil {
			tb.Fatal(err)
		}
		if len(src) > 24000 {
			src = src[:24000]
		}
		msgs = append(msgs,
			Message{Role: "user", Content: fmt.Sprintf("Step %d: what does %s do? %s", i, filepath.Base(files[i%len(files)]), texts[(i*7)%len(texts)])},
			Message{Role: "assistant", Content: "<think>\nI should read the file first.\n</think>\n\nReading it."},
			Message{Role: "tool", Content: `{"path": "` + files[i%len(files)] + `", "content": ` + fmt.Sprintf("%q", string(src)) + `}`},
			Message{Role: "assistant", Content: "It implements part of the HTTP stack: " + texts[(i*13)%len(texts)] + " 这个文件实现了HTTP协议的一部分。"},
		)
		s, err := tok.ApplyChatTemplate(msgs, ChatOptions{AddGenerationPrompt: true})
		if err != nil {
			tb.Fatal(err)
		}
		total = tok.Count(s, false)
		if total >= promptTokens {
			return s
		}
	}
	panic("unreachable")
}

// cpuTime is the process's user+system CPU time (the machine this runs on may be shared, so
// the benchmark reports CPU time beside wall time).
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkEncode32K encodes a 32K-token prompt and prints
// "tokenize: N µs per 32K-token prompt" (scaled to exactly 32,768 tokens), with the word
// cache warm (the gateway's steady state: each turn re-encodes the history) and cold (cache
// off: every piece goes through the BPE merges).
func BenchmarkEncode32K(b *testing.B) {
	for _, name := range models {
		for _, warm := range []bool{true, false} {
			label := "warm"
			if !warm {
				label = "cold"
			}
			b.Run(name+"/"+label, func(b *testing.B) {
				tok := model(b, name)
				prompt := benchPrompt(b, model(b, "qwen3"))
				n := tok.Count(prompt, false)
				if !warm {
					old := cacheMax
					cacheMax = 0
					defer func() { cacheMax = old }()
				}
				b.SetBytes(int64(len(prompt)))
				b.ResetTimer()
				start, cpu0 := time.Now(), cpuTime()
				for i := 0; i < b.N; i++ {
					_ = tok.Encode(prompt, false)
				}
				el, cpu := time.Since(start), cpuTime()-cpu0
				scale := float64(promptTokens) / float64(n) / float64(b.N)
				per := float64(el.Microseconds()) * scale
				b.ReportMetric(per, "µs/32Ktok")
				b.ReportMetric(float64(cpu.Microseconds())*scale, "cpu-µs/32Ktok")
				if b.N > 1 {
					fmt.Printf("tokenize: %.0f µs per 32K-token prompt (%s, %s cache, cpu %.0f µs, %d tokens, %d bytes, GOMAXPROCS %d)\n",
						per, name, label, float64(cpu.Microseconds())*scale, n, len(prompt), runtime.GOMAXPROCS(0))
				}
			})
		}
	}
}

// BenchmarkChatTemplate32K renders the 32K-token conversation with the Qwen3 template.
func BenchmarkChatTemplate32K(b *testing.B) {
	tok := model(b, "qwen3")
	var msgs []Message
	for i := 0; i < 40; i++ {
		msgs = append(msgs, Message{Role: "user", Content: strings.Repeat("word ", 400)}, Message{Role: "assistant", Content: strings.Repeat("answer ", 400)})
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := tok.ApplyChatTemplate(msgs, ChatOptions{AddGenerationPrompt: true}); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLoad is the gateway's start-up cost of reading a tokenizer folder.
func BenchmarkLoad(b *testing.B) {
	for _, name := range models {
		b.Run(name, func(b *testing.B) {
			dir := modelDir(b, name)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := Load(dir); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkEncodeParallel: goroutines encoding 32K-token prompts on one shared tokenizer (the
// gateway's case), warm cache.
func BenchmarkEncodeParallel(b *testing.B) {
	tok := model(b, "qwen3")
	prompt := benchPrompt(b, tok)
	_ = tok.Encode(prompt, false)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			_ = tok.Encode(prompt, false)
		}
	})
}
