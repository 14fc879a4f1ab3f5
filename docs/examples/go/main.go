// Command delay-example speaks kdelay's request protocol from Go with franz-go: no kdelay
// library, only records with kdelay-* headers on the requests topic.
//
// Usage: delay-example [target-topic] (default "orders"). The broker comes from
// KDELAY_BOOTSTRAP_SERVERS, the topics from KDELAY_REQUESTS_TOPIC and KDELAY_OUTCOMES_TOPIC
// (kdelay's defaults otherwise). It exits 1 when anything arrives early, the cancelled
// record arrives, or an expected record or outcome does not.
package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

const timeout = 60 * time.Second

var (
	requestsTopic = env("KDELAY_REQUESTS_TOPIC", "kdelay.requests")
	outcomesTopic = env("KDELAY_OUTCOMES_TOPIC", "kdelay.outcomes")
	brokers       = strings.Split(env("KDELAY_BOOTSTRAP_SERVERS", "127.0.0.1:9092"), ",")
)

func main() {
	target := "orders"
	if len(os.Args) > 1 {
		target = os.Args[1]
	}
	run := randomHex(4) // tells this run's records apart
	ctx := context.Background()

	// The default partitioner: keyed records go where murmur2 of the key says, as kdelay expects.
	client, err := kgo.NewClient(kgo.SeedBrokers(brokers...), kgo.RequiredAcks(kgo.AllISRAcks()))
	check(err)
	defer client.Close()
	admin := kadm.NewClient(client)
	partitions := len(endOffsets(ctx, admin, requestsTopic))
	arrivals := watch(ctx, admin, target) // from the target's end, before anything is written
	defer arrivals.Close()
	due := time.Now().UnixMilli() + 3_000 // an absolute due time just ahead

	// 1. Three ways to say when: an absolute due time, a delay, a delay level (level 1 = 1 s).
	send(ctx, client, request(target, run, "", "by-due", "kdelay-due-ms", due))
	send(ctx, client, request(target, run, "", "by-delay", "kdelay-delay-ms", 3_000))
	send(ctx, client, request(target, run, "", "by-level", "kdelay-level", 1))

	// 2. An id, keyed by a business key: the default partitioner (murmur2 of the key) places
	//    it, maybe off the id's home partition; kdelay forwards it there.
	orderID := "order-" + run
	mark := outcomeMark(ctx, admin, orderID)
	withID := request(target, run, "customer-7", "with-id", "kdelay-due-ms", due)
	withID.Headers = append(withID.Headers, header("kdelay-id", orderID))
	placed := send(ctx, client, withID)
	byKey, home := partitionOf("customer-7", partitions), partitionOf(orderID, partitions)
	if placed.Partition != byKey {
		fail("the default partitioner put customer-7 on %d, murmur2 says %d", placed.Partition, byKey)
	}
	where := "forwarded by kdelay"
	if placed.Partition == home {
		where = "at home"
	}
	fmt.Printf("placed with-id key=customer-7 partition=%d id-home=%d (%s)\n", placed.Partition, home, where)
	expect(awaitOutcome(ctx, orderID, placed, mark), "scheduled")

	// 3. Schedule and cancel: keyed by the id, both land on the id's home partition
	//    (murmur2 of the id), where Kafka keeps them in the order written.
	cancelID := "cancel-" + run
	doomed := request(target, run, cancelID, "cancelled", "kdelay-due-ms", due)
	doomed.Headers = append(doomed.Headers, header("kdelay-id", cancelID))
	send(ctx, client, doomed)
	mark = outcomeMark(ctx, admin, cancelID)
	cancel := &kgo.Record{Topic: requestsTopic, Key: []byte(cancelID), Value: []byte(cancelID),
		Headers: []kgo.RecordHeader{header("kdelay-cancel", cancelID)}}
	cancelAt := send(ctx, client, cancel)
	if cancelAt.Partition != partitionOf(cancelID, partitions) {
		fail("the cancel missed its id's home partition")
	}
	expect(awaitOutcome(ctx, cancelID, cancelAt, mark), "cancelled")

	// 4. Schedule an hour ahead, then reschedule to the due time: no payload sent again.
	movedID := "moved-" + run
	later := request(target, run, movedID, "rescheduled", "kdelay-delay-ms", 3_600_000)
	later.Headers = append(later.Headers, header("kdelay-id", movedID))
	send(ctx, client, later)
	mark = outcomeMark(ctx, admin, movedID)
	reschedule := &kgo.Record{Topic: requestsTopic, Key: []byte(movedID), Value: []byte(movedID),
		Headers: []kgo.RecordHeader{header("kdelay-reschedule", movedID),
			header("kdelay-due-ms", strconv.FormatInt(due, 10))}}
	expect(awaitOutcome(ctx, movedID, send(ctx, client, reschedule), mark), "rescheduled")

	// 5. What arrives on the target: everything but the cancelled one, none before its due time.
	checkArrivals(ctx, arrivals, run, []string{"by-due", "by-delay", "by-level", "with-id", "rescheduled"},
		"cancelled", due)
	fmt.Println("ok")
}

// request is a request for target; timeHeader is one of kdelay-due-ms, kdelay-delay-ms, kdelay-level.
func request(target, run, key, value, timeHeader string, when int64) *kgo.Record {
	record := &kgo.Record{Topic: requestsTopic, Value: []byte(value), Headers: []kgo.RecordHeader{
		header("kdelay-target", target),
		header(timeHeader, strconv.FormatInt(when, 10)),
		header("example-run", run), // your own headers travel with the record
	}}
	if key != "" {
		record.Key = []byte(key)
	}
	return record
}

func header(name, value string) kgo.RecordHeader {
	return kgo.RecordHeader{Key: name, Value: []byte(value)}
}

// send writes a record and waits for its acknowledgement: it says where the request lies.
func send(ctx context.Context, client *kgo.Client, record *kgo.Record) *kgo.Record {
	written, err := client.ProduceSync(ctx, record).First()
	check(err)
	return written
}

// partitionOf is the Java client's default partition for a key, murmur2: the id's home partition.
func partitionOf(key string, partitions int) int32 {
	murmur2 := kgo.StickyKeyPartitioner(nil).ForTopic("")
	return int32(murmur2.Partition(&kgo.Record{Key: []byte(key)}, partitions))
}

// endOffsets is each partition's end offset of topic.
func endOffsets(ctx context.Context, admin *kadm.Client, topic string) map[int32]kadm.ListedOffset {
	listed, err := admin.ListEndOffsets(ctx, topic)
	check(err)
	check(listed.Error())
	if len(listed[topic]) == 0 {
		fail("topic %s not found", topic)
	}
	return listed[topic]
}

// outcomeStart is where to read an id's outcome from: its partition and that partition's end offset.
type outcomeStart struct {
	partition int32
	offset    int64
}

// outcomeMark notes where the id's outcome will be: call it before writing the request.
func outcomeMark(ctx context.Context, admin *kadm.Client, id string) outcomeStart {
	ends := endOffsets(ctx, admin, outcomesTopic)
	partition := partitionOf(id, len(ends))
	return outcomeStart{partition, ends[partition].Offset}
}

// awaitOutcome reads the id's outcome partition from mark until an outcome answers request.
func awaitOutcome(ctx context.Context, id string, request *kgo.Record, mark outcomeStart) string {
	coordinates := fmt.Sprintf("%s/%d/%d", request.Topic, request.Partition, request.Offset)
	reader, err := kgo.NewClient(kgo.SeedBrokers(brokers...),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), // kdelay may write in transactions
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{
			outcomesTopic: {mark.partition: kgo.NewOffset().At(mark.offset)}}))
	check(err)
	defer reader.Close()
	ctx, stop := context.WithTimeout(ctx, timeout)
	defer stop()
	for ctx.Err() == nil {
		fetches := reader.PollFetches(ctx)
		for iter := fetches.RecordIter(); !iter.Done(); {
			var answer struct{ Outcome, Request string }
			check(json.Unmarshal(iter.Next().Value, &answer))
			if answer.Request == coordinates {
				fmt.Printf("outcome %s %s request=%s\n", id, answer.Outcome, coordinates)
				return answer.Outcome
			}
		}
	}
	fail("no outcome for %s within %s", id, timeout)
	return ""
}

// watch reads the target from its end as it is now, before this run's requests are written.
func watch(ctx context.Context, admin *kadm.Client, target string) *kgo.Client {
	from := map[int32]kgo.Offset{}
	for partition, end := range endOffsets(ctx, admin, target) {
		from[partition] = kgo.NewOffset().At(end.Offset)
	}
	reader, err := kgo.NewClient(kgo.SeedBrokers(brokers...),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{target: from}))
	check(err)
	return reader
}

// checkArrivals waits for expected and fails on an early record or on cancelled (until due + 2 s).
func checkArrivals(ctx context.Context, reader *kgo.Client, run string, expected []string, cancelled string, due int64) {
	arrived := map[string]bool{}
	deadline := time.Now().Add(timeout)
	for !(allIn(expected, arrived) && time.Now().UnixMilli() > due+2_000) {
		if time.Now().After(deadline) {
			fail("arrived %v, expected %v", arrived, expected)
		}
		poll, stop := context.WithTimeout(ctx, 200*time.Millisecond)
		fetches := reader.PollFetches(poll)
		stop()
		for iter := fetches.RecordIter(); !iter.Done(); {
			record := iter.Next()
			if headerOf(record, "example-run") != run {
				continue // someone else's record
			}
			dueMs, err := strconv.ParseInt(headerOf(record, "kdelay-due-ms"), 10, 64)
			check(err)
			value := string(record.Value)
			fmt.Printf("arrived %s key=%s due=%d late_ms=%d origin=%s\n", value, record.Key, dueMs,
				record.Timestamp.UnixMilli()-dueMs, headerOf(record, "kdelay-origin"))
			if value == cancelled {
				fail("the cancelled record arrived")
			}
			if record.Timestamp.UnixMilli() < dueMs {
				fail("%s arrived before its due time", value)
			}
			arrived[value] = true
		}
	}
	fmt.Println("never arrived " + cancelled)
}

func headerOf(record *kgo.Record, name string) string {
	for _, h := range record.Headers {
		if h.Key == name {
			return string(h.Value)
		}
	}
	return ""
}

func allIn(names []string, set map[string]bool) bool {
	for _, name := range names {
		if !set[name] {
			return false
		}
	}
	return true
}

func expect(outcome, wanted string) {
	if outcome != wanted {
		fail("outcome %s, expected %s", outcome, wanted)
	}
}

func check(err error) {
	if err != nil {
		fail("%v", err)
	}
}

func fail(format string, args ...any) {
	fmt.Printf("FAILED: "+format+"\n", args...)
	os.Exit(1)
}

func env(name, fallback string) string {
	if value := os.Getenv(name); value != "" {
		return value
	}
	return fallback
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
