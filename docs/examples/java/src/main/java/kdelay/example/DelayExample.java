package kdelay.example;

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.UUID;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.header.Header;
import org.apache.kafka.common.serialization.StringDeserializer;
import org.apache.kafka.common.serialization.StringSerializer;
import org.apache.kafka.common.utils.Utils;

/**
 * kdelay's request protocol from the Apache Kafka Java client: no kdelay library,
 * only records with {@code kdelay-*} headers on the requests topic.
 *
 * <p>Usage: {@code DelayExample [target-topic]} (default {@code orders}); the broker comes
 * from {@code KDELAY_BOOTSTRAP_SERVERS}, the topics from {@code KDELAY_REQUESTS_TOPIC} and
 * {@code KDELAY_OUTCOMES_TOPIC} (kdelay's defaults otherwise). Exits 1 when anything
 * arrives early, the cancelled record arrives, or an expected record or outcome does not.
 */
public final class DelayExample {
    static final String REQUESTS = env("KDELAY_REQUESTS_TOPIC", "kdelay.requests");
    static final String OUTCOMES = env("KDELAY_OUTCOMES_TOPIC", "kdelay.outcomes");
    static final Duration TIMEOUT = Duration.ofSeconds(60);

    public static void main(String[] args) throws Exception {
        String bootstrap = env("KDELAY_BOOTSTRAP_SERVERS", "127.0.0.1:9092");
        String target = args.length > 0 ? args[0] : "orders";
        String run = UUID.randomUUID().toString().substring(0, 8);  // tells this run's records apart

        try (KafkaProducer<String, String> producer = new KafkaProducer<>(producerConfig(bootstrap));
             Outcomes outcomes = new Outcomes(bootstrap);
             Target arrivals = new Target(bootstrap, target, run)) {
            int partitions = producer.partitionsFor(REQUESTS).size();
            long due = System.currentTimeMillis() + 3_000;  // an absolute due time just ahead

            // 1. Three ways to say when: an absolute due time, a delay, a delay level (level 1 = 1 s).
            send(producer, request(target, run, null, "by-due", "kdelay-due-ms", due));
            send(producer, request(target, run, null, "by-delay", "kdelay-delay-ms", 3_000));
            send(producer, request(target, run, null, "by-level", "kdelay-level", 1));

            // 2. An id, keyed by a business key: the default partitioner (murmur2 of the key)
            //    places it, maybe off the id's home partition; kdelay forwards it there.
            String orderId = "order-" + run;
            long mark = outcomes.mark(orderId);
            ProducerRecord<String, String> withId =
                request(target, run, "customer-7", "with-id", "kdelay-due-ms", due);
            header(withId, "kdelay-id", orderId);
            RecordMetadata placed = send(producer, withId);
            int byKey = partitionOf("customer-7", partitions);
            int home = partitionOf(orderId, partitions);
            if (placed.partition() != byKey) {
                fail("the default partitioner put customer-7 on " + placed.partition() + ", murmur2 says " + byKey);
            }
            System.out.printf("placed with-id key=customer-7 partition=%d id-home=%d (%s)%n",
                placed.partition(), home, placed.partition() == home ? "at home" : "forwarded by kdelay");
            expect(outcomes.await(orderId, placed, mark), "scheduled");

            // 3. Schedule and cancel: keyed by the id, both land on the id's home partition
            //    (murmur2 of the id), where Kafka keeps them in the order written.
            String cancelId = "cancel-" + run;
            ProducerRecord<String, String> doomed = request(target, run, cancelId, "cancelled", "kdelay-due-ms", due);
            header(doomed, "kdelay-id", cancelId);
            send(producer, doomed);
            mark = outcomes.mark(cancelId);
            ProducerRecord<String, String> cancel = new ProducerRecord<>(REQUESTS, cancelId, cancelId);
            header(cancel, "kdelay-cancel", cancelId);
            RecordMetadata cancelAt = send(producer, cancel);
            if (cancelAt.partition() != partitionOf(cancelId, partitions)) {
                fail("the cancel missed its id's home partition");
            }
            expect(outcomes.await(cancelId, cancelAt, mark), "cancelled");

            // 4. Schedule an hour ahead, then reschedule to the due time: no payload sent again.
            String movedId = "moved-" + run;
            ProducerRecord<String, String> later =
                request(target, run, movedId, "rescheduled", "kdelay-delay-ms", 3_600_000);
            header(later, "kdelay-id", movedId);
            send(producer, later);
            mark = outcomes.mark(movedId);
            ProducerRecord<String, String> reschedule = new ProducerRecord<>(REQUESTS, movedId, movedId);
            header(reschedule, "kdelay-reschedule", movedId);
            header(reschedule, "kdelay-due-ms", due);
            expect(outcomes.await(movedId, send(producer, reschedule), mark), "rescheduled");

            // 5. What arrives on the target: everything but the cancelled one, none before its due time.
            arrivals.check(Set.of("by-due", "by-delay", "by-level", "with-id", "rescheduled"),
                "cancelled", due);
        }
        System.out.println("ok");
    }

    /** A request for {@code target}; {@code timeHeader} is one of kdelay-due-ms, kdelay-delay-ms, kdelay-level. */
    static ProducerRecord<String, String> request(String target, String run, String key, String value,
                                                  String timeHeader, long time) {
        ProducerRecord<String, String> record = new ProducerRecord<>(REQUESTS, key, value);
        header(record, "kdelay-target", target);
        header(record, timeHeader, time);
        header(record, "example-run", run);  // your own headers travel with the record
        return record;
    }

    static void header(ProducerRecord<String, String> record, String name, Object value) {
        record.headers().add(name, String.valueOf(value).getBytes(StandardCharsets.UTF_8));
    }

    /** The Java client's default partition for a key: what kdelay calls the id's home partition. */
    static int partitionOf(String key, int partitions) {
        return Utils.toPositive(Utils.murmur2(key.getBytes(StandardCharsets.UTF_8))) % partitions;
    }

    static RecordMetadata send(KafkaProducer<String, String> producer, ProducerRecord<String, String> record)
            throws Exception {
        return producer.send(record).get();  // wait for the acknowledgement: it says where the request lies
    }

    static void expect(String outcome, String wanted) {
        if (!wanted.equals(outcome)) {
            fail("outcome " + outcome + ", expected " + wanted);
        }
    }

    static void fail(String why) {
        System.out.println("FAILED: " + why);
        System.exit(1);
    }

    static String env(String name, String fallback) {
        String value = System.getenv(name);
        return value == null || value.isEmpty() ? fallback : value;
    }

    static Properties producerConfig(String bootstrap) {
        Properties config = new Properties();
        config.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        config.put(ProducerConfig.ACKS_CONFIG, "all");
        config.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, StringSerializer.class);
        config.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, StringSerializer.class);
        // No partitioner.class: keyed records go where murmur2 of the key says, as kdelay expects.
        return config;
    }

    static Properties consumerConfig(String bootstrap) {
        Properties config = new Properties();
        config.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        config.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");  // kdelay may write in transactions
        config.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, false);
        config.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class);
        config.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, StringDeserializer.class);
        return config;
    }

    static String headerOf(ConsumerRecord<String, String> record, String name) {
        Header header = record.headers().lastHeader(name);
        return header == null ? null : new String(header.value(), StandardCharsets.UTF_8);
    }

    /** The outcomes topic: one record per request with an id, on the id's murmur2 partition. */
    static final class Outcomes implements AutoCloseable {
        private static final Pattern FIELD = Pattern.compile("\"(outcome|request)\"\\s*:\\s*\"([^\"]*)\"");
        private final KafkaConsumer<String, String> consumer;
        private final int partitions;

        Outcomes(String bootstrap) {
            consumer = new KafkaConsumer<>(consumerConfig(bootstrap));
            partitions = consumer.partitionsFor(OUTCOMES).size();
        }

        /** The end offset of the id's outcome partition: note it before writing the request. */
        long mark(String id) {
            TopicPartition partition = new TopicPartition(OUTCOMES, partitionOf(id, partitions));
            return consumer.endOffsets(List.of(partition)).get(partition);
        }

        /** Read the id's partition from {@code from} until an outcome answers {@code request}. */
        String await(String id, RecordMetadata request, long from) {
            String coordinates = request.topic() + "/" + request.partition() + "/" + request.offset();
            TopicPartition partition = new TopicPartition(OUTCOMES, partitionOf(id, partitions));
            consumer.assign(List.of(partition));
            consumer.seek(partition, from);
            long deadline = System.currentTimeMillis() + TIMEOUT.toMillis();
            while (System.currentTimeMillis() < deadline) {
                for (ConsumerRecord<String, String> record : consumer.poll(Duration.ofMillis(200))) {
                    Map<String, String> fields = new HashMap<>();  // use your JSON library here
                    Matcher matcher = FIELD.matcher(record.value());
                    while (matcher.find()) {
                        fields.put(matcher.group(1), matcher.group(2));
                    }
                    if (coordinates.equals(fields.get("request"))) {
                        System.out.printf("outcome %s %s request=%s%n", id, fields.get("outcome"), coordinates);
                        return fields.get("outcome");
                    }
                }
            }
            fail("no outcome for " + id + " within " + TIMEOUT);
            return null;
        }

        @Override
        public void close() {
            consumer.close();
        }
    }

    /** The target topic, read from its end as it was before this run's requests were written. */
    static final class Target implements AutoCloseable {
        private final KafkaConsumer<String, String> consumer;
        private final String run;

        Target(String bootstrap, String topic, String run) {
            this.run = run;
            consumer = new KafkaConsumer<>(consumerConfig(bootstrap));
            List<TopicPartition> partitions = new ArrayList<>();
            for (PartitionInfo info : consumer.partitionsFor(topic)) {
                partitions.add(new TopicPartition(topic, info.partition()));
            }
            consumer.assign(partitions);
            consumer.seekToEnd(partitions);
            partitions.forEach(consumer::position);  // fix the start now, before anything is delivered
        }

        /** Wait for {@code expected}; fail on an early record or on {@code cancelled} (until due + 2 s). */
        void check(Set<String> expected, String cancelled, long due) {
            Set<String> arrived = new HashSet<>();
            long deadline = System.currentTimeMillis() + TIMEOUT.toMillis();
            while (!(arrived.containsAll(expected) && System.currentTimeMillis() > due + 2_000)) {
                if (System.currentTimeMillis() > deadline) {
                    fail("arrived " + arrived + ", expected " + expected);
                }
                for (ConsumerRecord<String, String> record : consumer.poll(Duration.ofMillis(200))) {
                    if (!run.equals(headerOf(record, "example-run"))) {
                        continue;  // someone else's record
                    }
                    long dueMs = Long.parseLong(headerOf(record, "kdelay-due-ms"));
                    System.out.printf("arrived %s key=%s due=%d late_ms=%d origin=%s%n", record.value(),
                        record.key(), dueMs, record.timestamp() - dueMs, headerOf(record, "kdelay-origin"));
                    if (record.value().equals(cancelled)) {
                        fail("the cancelled record arrived");
                    }
                    if (record.timestamp() < dueMs) {
                        fail(record.value() + " arrived before its due time");
                    }
                    arrived.add(record.value());
                }
            }
            System.out.println("never arrived " + cancelled);
        }

        @Override
        public void close() {
            consumer.close();
        }
    }

    private DelayExample() {
    }
}
