// Package netproxy is a TCP proxy for fault-injection tests: it forwards every connection
// accepted on a loopback port to a target address, and can black-hole the link (Blackhole)
// and restore it (Heal) without closing any connection.
//
// # Overview
//
// A black hole stops moving bytes in both directions: the proxy neither reads from nor
// writes to either side, so what the peers send stays in kernel buffers (and then blocks
// them), as with packets dropped by a firewall and retransmitted by TCP. Connections stay
// open; keepalives go unanswered; nothing is reset. New connections are accepted but carry
// nothing until Heal. After Heal the held bytes flow in order, as retransmissions would.
// Close (or the test's cleanup) closes the listener and every connection.
//
// # Concurrency Model
//
// One goroutine accepts; each connection has one copying goroutine per direction. Every
// method is safe for concurrent use.
package netproxy
