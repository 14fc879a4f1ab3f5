// The broker's own figures for tools/bench: attach to a running Kafka broker's JVM
// (same user, same machine), start its local JMX agent, and print the numeric
// attributes of the MBeans named by the pattern arguments as one JSON line for
// every line read on stdin ("read"); end of input ends the program. The JVM's
// safepoint counters (sun.rt.safepoint*, as `jcmd PID PerfCounter.print` shows
// them, from the JVM's performance data; not in JMX) come as the bean
// "jvm:type=PerfCounter". The CPU time of the broker's Java threads, summed by
// name with digits folded ("kafka-log-cleaner-thread-N"), in nanoseconds, comes
// as the bean "jvm:type=ThreadCpu".
//
//   java --add-exports jdk.internal.jvmstat/sun.jvmstat.monitor=ALL-UNNAMED \
//       tools/jmx/BrokerMetrics.java PID 'kafka.network:type=RequestMetrics,*' ...
//
// Output: {"t_ms": <monotonic ms>, "beans": {"<object name>": {"<attribute>": n}}}
// Attributes that are not numbers (composites, strings) or cannot be read are left
// out; so is a bean unregistered between the query and the read.
// Errors go to stderr as one line and end the program with exit code 1.

import com.sun.tools.attach.VirtualMachine;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.lang.management.ManagementFactory;
import java.util.ArrayList;
import java.util.List;
import java.util.TreeMap;
import java.util.TreeSet;
import javax.management.Attribute;
import javax.management.MBeanAttributeInfo;
import javax.management.MBeanServerConnection;
import javax.management.ObjectName;
import javax.management.remote.JMXConnector;
import javax.management.remote.JMXConnectorFactory;
import javax.management.remote.JMXServiceURL;
import sun.jvmstat.monitor.Monitor;
import sun.jvmstat.monitor.MonitoredHost;
import sun.jvmstat.monitor.MonitoredVm;
import sun.jvmstat.monitor.VmIdentifier;

public final class BrokerMetrics {
    private BrokerMetrics() {}

    public static void main(String[] args) throws Exception {
        if (args.length < 2) {
            System.err.println("usage: BrokerMetrics PID OBJECT_NAME_PATTERN...");
            System.exit(2);
        }
        List<ObjectName> patterns = new ArrayList<>();
        for (int i = 1; i < args.length; i++) {
            patterns.add(new ObjectName(args[i]));
        }
        try {
            VirtualMachine vm = VirtualMachine.attach(args[0]);
            String url = vm.startLocalManagementAgent();
            vm.detach();
            MonitoredVm perf = MonitoredHost.getMonitoredHost("localhost")
                    .getMonitoredVm(new VmIdentifier(args[0]));
            try (JMXConnector connector = JMXConnectorFactory.connect(new JMXServiceURL(url))) {
                serve(connector.getMBeanServerConnection(), perf, patterns);
            } finally {
                perf.detach();
            }
        } catch (Exception e) {
            System.err.println("BrokerMetrics: " + e);
            System.exit(1);
        }
    }

    private static void serve(MBeanServerConnection server, MonitoredVm perf,
            List<ObjectName> patterns) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        while (in.readLine() != null) {
            System.out.println(read(server, perf, patterns));
            System.out.flush();
        }
    }

    private static String safepoints(MonitoredVm perf) throws Exception {
        StringBuilder out = new StringBuilder("{");
        String names = "sun\\.rt\\.safepoint.*|sun\\.os\\.hrt\\.frequency";
        for (Monitor monitor : perf.findByPattern(names)) {
            if (monitor.getValue() instanceof Number number) {
                out.append(out.length() > 1 ? ", " : "").append(quote(monitor.getName()))
                   .append(": ").append(number.longValue());
            }
        }
        return out.append("}").toString();
    }

    private static String threadCpu(MBeanServerConnection server) throws Exception {
        com.sun.management.ThreadMXBean threads = ManagementFactory.newPlatformMXBeanProxy(
                server, ManagementFactory.THREAD_MXBEAN_NAME,
                com.sun.management.ThreadMXBean.class);
        long[] ids = threads.getAllThreadIds();
        java.lang.management.ThreadInfo[] infos = threads.getThreadInfo(ids);
        long[] cpu = threads.getThreadCpuTime(ids);
        TreeMap<String, Long> byName = new TreeMap<>();
        for (int i = 0; i < ids.length; i++) {
            if (infos[i] != null && cpu[i] > 0) {
                byName.merge(infos[i].getThreadName().replaceAll("[0-9]+", "N"), cpu[i], Long::sum);
            }
        }
        StringBuilder out = new StringBuilder("{");
        byName.forEach((name, ns) -> out.append(out.length() > 1 ? ", " : "")
                .append(quote(name)).append(": ").append(ns));
        return out.append("}").toString();
    }

    private static String read(MBeanServerConnection server, MonitoredVm perf,
            List<ObjectName> patterns) throws Exception {
        TreeSet<ObjectName> names = new TreeSet<>();
        for (ObjectName pattern : patterns) {
            names.addAll(server.queryNames(pattern, null));
        }
        StringBuilder out = new StringBuilder();
        out.append("{\"t_ms\": ").append(System.nanoTime() / 1_000_000L).append(", \"beans\": {")
           .append(quote("jvm:type=PerfCounter")).append(": ").append(safepoints(perf))
           .append(", ").append(quote("jvm:type=ThreadCpu")).append(": ")
           .append(threadCpu(server));
        for (ObjectName name : names) {
            String attributes;
            try {
                attributes = numbers(server, name);
            } catch (javax.management.InstanceNotFoundException gone) {
                continue;
            }
            out.append(", ").append(quote(name.toString())).append(": ").append(attributes);
        }
        return out.append("}}").toString();
    }

    private static String numbers(MBeanServerConnection server, ObjectName name)
            throws Exception {
        List<String> readable = new ArrayList<>();
        for (MBeanAttributeInfo info : server.getMBeanInfo(name).getAttributes()) {
            if (info.isReadable()) {
                readable.add(info.getName());
            }
        }
        StringBuilder out = new StringBuilder("{");
        boolean first = true;
        for (Attribute attribute : server.getAttributes(name, readable.toArray(new String[0]))
                .asList()) {
            if (!(attribute.getValue() instanceof Number number)
                    || !Double.isFinite(number.doubleValue())) {
                continue;
            }
            out.append(first ? "" : ", ").append(quote(attribute.getName())).append(": ")
               .append(number instanceof Double || number instanceof Float
                       ? Double.toString(number.doubleValue()) : number.toString());
            first = false;
        }
        return out.append("}").toString();
    }

    private static String quote(String text) {
        StringBuilder out = new StringBuilder("\"");
        for (char c : text.toCharArray()) {
            if (c == '"' || c == '\\') {
                out.append('\\').append(c);
            } else if (c < 0x20) {
                out.append(String.format("\\u%04x", (int) c));
            } else {
                out.append(c);
            }
        }
        return out.append('"').toString();
    }
}
