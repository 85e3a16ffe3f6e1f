// Package routeclient keeps one RouterService.Route stream open to the control-plane leader and
// multiplexes concurrent routing queries over it (request_id -> waiter). It follows leader hints
// (cpclient.Endpoints), reconnects with jittered backoff, and answers fast with ErrUnavailable
// when no stream is up, so the gateway can fail open instead of hanging.
package routeclient
