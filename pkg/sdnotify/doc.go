// Package sdnotify tells systemd where a daemon of a Type=notify unit stands: READY=1 once it
// serves, STATUS= lines, WATCHDOG=1 pings while a health check passes, STOPPING=1 as it stops.
package sdnotify
