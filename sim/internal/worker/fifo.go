package worker

import "sync"

// fifoQueue orders allocations that must wait for room first-come first-served, as SGLang's
// decode prealloc queue and prefill waiting queue do: only the head of the queue allocates, so a
// large request at the head is not overtaken forever by small ones that keep fitting, and a
// request waits behind those that came before it. The zero value is an empty queue.
type fifoQueue struct {
	mu      sync.Mutex
	waiters []*fifoTicket
}

type fifoTicket struct {
	head chan struct{} // closed when the ticket reaches the head of the queue
}

// join appends a ticket; it is at the head at once when the queue was empty.
func (q *fifoQueue) join() *fifoTicket {
	t := &fifoTicket{head: make(chan struct{})}
	q.mu.Lock()
	q.waiters = append(q.waiters, t)
	if len(q.waiters) == 1 {
		close(t.head)
	}
	q.mu.Unlock()
	return t
}

// leave removes t (served, timed out or abandoned); when t was the head, the next ticket
// becomes the head.
func (q *fifoQueue) leave(t *fifoTicket) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for i, x := range q.waiters {
		if x != t {
			continue
		}
		q.waiters = append(q.waiters[:i], q.waiters[i+1:]...)
		if i == 0 && len(q.waiters) > 0 {
			close(q.waiters[0].head)
		}
		return
	}
}

// len is the number of tickets queued (the head included).
func (q *fifoQueue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiters)
}
