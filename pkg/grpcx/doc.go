// Package grpcx is the one gRPC server setup shared by every kvcentric binary: reflection,
// health, zerolog request logging and panic recovery through go-grpc-middleware v2, request
// validation (messages with a Validate() error method), message size limits, keepalive
// enforcement matching our clients, and a graceful stop tied to a context.
package grpcx
