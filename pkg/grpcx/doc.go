// Package grpcx is the one gRPC server setup shared by every kvcentric binary: reflection,
// health, zerolog request logging and panic recovery through go-grpc-middleware v2, request
// validation (messages with a Validate() error method), message size limits (servers accept
// 4 MiB unless WithMaxRecvMsgSize), keepalive enforcement matching our clients, and a graceful
// stop tied to a context.
//
// Request messages that do not decode (malformed wire bytes, strings that are not UTF-8) are
// answered INVALID_ARGUMENT, not grpc-go's INTERNAL: the server's codec records the decode
// error and an interceptor refuses the call (or the stream's message) before any handler.
//
// Transport security: WithTLS(src) turns a server into a mutual-TLS server whose calls are
// authorized per method by the caller's certificate role (package tlsx: roles, the table,
// rotation). Clients dial with DialOptions(src, serverRoles...), which is plaintext when src is
// nil. Servers on Unix sockets (the WorkerBridge) stay plaintext.
package grpcx
