// Command kvc-gateway is kvcentric's HTTP front door: OpenAI-compatible and SGLang /generate
// APIs, one Route stream to the control-plane leader, fail-open plain P/D when none answers.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvcentric/kvcentric/gateway/internal/app"
	"github.com/kvcentric/kvcentric/gateway/internal/config"
)

func main() { os.Exit(run()) }

func run() int {
	cfg, err := config.Parse(os.Args[1:], os.Getenv, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "kvc-gateway:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	// The first signal starts the graceful stop (readiness off, in-flight streams get
	// --shutdown-grace); a second one kills the process at once (the default action).
	context.AfterFunc(ctx, stop)
	if err := app.Run(ctx, cfg, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "kvc-gateway:", err)
		if errors.Is(err, app.ErrStartup) {
			return 2
		}
		return 1
	}
	return 0
}
