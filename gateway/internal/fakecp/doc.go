// Package fakecp is a test double of the control plane's RouterService and AdminService served
// over real gRPC (pkg/grpcx) on a port-0 loopback listener. The real control plane lives in
// another module that the gateway must not import; tests script decisions here instead.
package fakecp
