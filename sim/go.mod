module github.com/kvcentric/kvcentric/sim

go 1.26.8

require (
	github.com/bufbuild/protocompile v0.14.1
	github.com/ebitengine/purego v0.11.3
	github.com/grpc-ecosystem/go-grpc-middleware/v2 v2.3.4
	github.com/prometheus/client_golang v1.25.0
	github.com/rs/zerolog v1.35.1
	go.etcd.io/etcd/client/v3 v3.7.3
	go.etcd.io/etcd/server/v3 v3.7.3
	golang.org/x/sync v0.25.0
	google.golang.org/grpc v1.85.0
	google.golang.org/protobuf v1.36.12
)

require github.com/kvcentric/kvcentric/proto v0.0.0-00010101000000-000000000000

replace github.com/kvcentric/kvcentric/proto => ../proto

require github.com/kvcentric/kvcentric/pkg v0.0.0-00010101000000-000000000000

require (
	github.com/anishathalye/porcupine v1.3.1 // indirect
	golang.org/x/image v0.48.0 // indirect
)

replace github.com/kvcentric/kvcentric/pkg => ../pkg
