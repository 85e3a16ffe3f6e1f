package sdnotify

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/coreos/go-systemd/v22/daemon"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
)

// Check reports whether the process is healthy enough to be kept (nil) or should be restarted
// by the service manager once its watchdog runs out (an error). It must return within ctx.
type Check func(ctx context.Context) error

// Notifier sends a daemon's state to the service manager (NOTIFY_SOCKET, through
// github.com/coreos/go-systemd/v22/daemon). Without NOTIFY_SOCKET every call does nothing. Safe
// for concurrent use.
type Notifier struct {
	log      zerolog.Logger
	interval time.Duration // WATCHDOG_USEC (systemd's WatchdogSec=); 0: no watchdog
	checks   *prometheus.CounterVec
	stopping sync.Once
}

// New reads the watchdog settings of the environment (WATCHDOG_USEC, WATCHDOG_PID) and
// registers kvc_watchdog_checks_total on reg (may be nil). A malformed WATCHDOG_USEC is logged
// and leaves the watchdog off.
func New(log zerolog.Logger, reg prometheus.Registerer) *Notifier {
	n := &Notifier{log: log.With().Str("part", "sd_notify").Logger()}
	d, err := daemon.SdWatchdogEnabled(false)
	if err != nil {
		n.log.Warn().Err(err).Msg("systemd watchdog settings unreadable: no WATCHDOG=1 pings")
	}
	n.interval = d
	n.checks = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "kvc_watchdog_checks_total",
		Help: "Health checks of the systemd watchdog loop by result (ok: WATCHDOG=1 sent; failed: no ping, systemd restarts the unit after WatchdogSec without one). None without WatchdogSec.",
	}, []string{"result"})
	n.checks.WithLabelValues("ok")
	n.checks.WithLabelValues("failed")
	if reg != nil {
		if err := reg.Register(n.checks); err != nil {
			n.log.Warn().Err(err).Msg("kvc_watchdog_checks_total not registered")
		}
	}
	return n
}

func (n *Notifier) send(state string) bool {
	sent, err := daemon.SdNotify(false, state)
	if err != nil {
		n.log.Warn().Err(err).Str("state", firstLine(state)).Msg("sd_notify")
	}
	return sent
}

// Ready says the daemon serves (READY=1), with a status line when status is not empty.
func (n *Notifier) Ready(status string) {
	if n.send(daemon.SdNotifyReady + statusLine(status)) {
		n.log.Debug().Str("status", status).Msg("READY=1 sent")
	}
}

// Status sets the status line systemctl status shows.
func (n *Notifier) Status(status string) { n.send("STATUS=" + oneLine(status)) }

// Stopping says the daemon began its shutdown (STOPPING=1), once: later calls send nothing, and
// return only after the first one's message went out. Call it as the stop begins (e.g. from
// context.AfterFunc, which runs it on its own goroutine) and again, synchronously, before the
// process exits, so the message is never lost to a quick exit.
func (n *Notifier) Stopping(status string) {
	n.stopping.Do(func() { n.send(daemon.SdNotifyStopping + statusLine(status)) })
}

// Watchdog sends WATCHDOG=1 every half of the watchdog interval while check passes, until ctx
// is done; a failed check sends nothing (logged, counted), so a process that stays unhealthy
// for a whole WatchdogSec is restarted by systemd. Each check gets a quarter of the interval.
// Without a watchdog (no WATCHDOG_USEC, or one meant for another process) it returns nil at
// once. It never returns an error: the watchdog must not stop the process itself.
func (n *Notifier) Watchdog(ctx context.Context, check Check) error {
	if n.interval <= 0 {
		return nil
	}
	every := n.interval / 2
	n.log.Info().Dur("watchdog_sec", n.interval).Dur("ping_every", every).Msg("systemd watchdog on")
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		n.tick(ctx, check)
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (n *Notifier) tick(ctx context.Context, check Check) {
	cctx, cancel := context.WithTimeout(ctx, n.interval/4)
	err := check(cctx)
	cancel()
	if ctx.Err() != nil {
		return
	}
	if err != nil {
		n.checks.WithLabelValues("failed").Inc()
		n.log.Warn().Err(err).Dur("watchdog_sec", n.interval).Msg("health check failed: no WATCHDOG=1 (systemd restarts the unit once none came for WatchdogSec)")
		return
	}
	n.checks.WithLabelValues("ok").Inc()
	n.send(daemon.SdNotifyWatchdog)
}

// HTTPProbe is a Check that GETs path (e.g. /healthz) from the process's own HTTP listener at
// addr (an unspecified IP is probed on loopback) and wants 200. With useTLS it speaks HTTPS
// without verifying the certificate: it checks that the process answers, not who it is.
func HTTPProbe(addr net.Addr, path string, useTLS bool) Check {
	host := addr.String()
	if ta, ok := addr.(*net.TCPAddr); ok && (ta.IP == nil || ta.IP.IsUnspecified()) {
		lo := "127.0.0.1"
		if ta.IP != nil && ta.IP.To4() == nil {
			lo = "::1"
		}
		host = net.JoinHostPort(lo, fmt.Sprint(ta.Port))
	}
	scheme := "http"
	tr := &http.Transport{DisableKeepAlives: true, Proxy: nil}
	if useTLS {
		scheme = "https"
		tr.TLSClientConfig = &tls.Config{InsecureSkipVerify: true} // liveness of this very process, not its identity
	}
	cl := &http.Client{Transport: tr}
	url := scheme + "://" + host + path
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := cl.Do(req)
		if err != nil {
			return fmt.Errorf("GET %s: %w", url, err)
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("GET %s: %s", url, resp.Status)
		}
		return nil
	}
}

func statusLine(s string) string {
	if s == "" {
		return ""
	}
	return "\nSTATUS=" + oneLine(s)
}

func oneLine(s string) string { return strings.ReplaceAll(s, "\n", " ") }

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
