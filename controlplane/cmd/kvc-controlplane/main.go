// Command kvc-controlplane is the kvcentric control plane: leader-elected through etcd, it
// keeps the session residency table, commands the sidecars and answers routing queries.
package main

import (
	"os"

	"github.com/kvcentric/kvcentric/controlplane/internal/app"
)

func main() { os.Exit(run()) }

func run() int { return app.Main(os.Args[1:], os.Stderr) }
